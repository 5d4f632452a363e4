"""The event loop against hand calculations: one replica whose every step takes the same time."""
from __future__ import annotations

import pytest

from shardserve.bench.stats import LoadLevel
from shardserve.sim.simulation import ServingOverheads
from shardserve.sim.workload import RequestSpec
from tests.sim.sim_helpers import config, constant_step_simulation

STEP_S = 0.01


def spec(prompt_len: int, output_len: int, arrival_s: float = 0.0) -> RequestSpec:
    return RequestSpec(tuple(range(100, 100 + prompt_len)), None, output_len, arrival_s)


def chunk_times(result, index: int) -> list[float]:
    record = next(r for r in result.records if r.index == index)
    return list(record.chunk_times_s)


def test_one_request_ttft_tpot_by_hand():
    delays = ServingOverheads(request_s=0.003, token_s=0.002)
    sim = constant_step_simulation(config(overheads=delays), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(100, 5)])
    # reaches the idle engine at 3 ms; the prefill step ends at 13 ms with the first token, then a
    # token every 10 ms; each reaches the client 2 ms after its step
    assert chunk_times(result, 0) == pytest.approx([0.015, 0.025, 0.035, 0.045, 0.055])
    assert result.ttft.p50_ms == pytest.approx(15.0)
    assert result.tpot.p50_ms == pytest.approx(10.0) and result.itl.p50_ms == pytest.approx(10.0)
    assert result.e2e.p50_ms == pytest.approx(55.0)
    assert result.wall_time_s == pytest.approx(0.055) and result.total_output_tokens == 5


def test_arrival_mid_step_waits_for_the_step_then_shares_the_next():
    sim = constant_step_simulation(config(), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(50, 6, 0.0), spec(40, 3, 0.025)])
    # first: steps end at 10, 20, 30 ms...; the second arrives in the step 20-30 ms, joins the
    # step 30-40 ms (its prefill beside the first's decode) and decodes after
    assert chunk_times(result, 0) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    assert chunk_times(result, 1) == pytest.approx([0.04, 0.05, 0.06])
    assert result.ttft.mean_ms == pytest.approx((10 + 15) / 2)


def test_arrival_exactly_at_a_step_end_joins_the_next_step():
    sim = constant_step_simulation(config(), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(50, 6, 0.0), spec(40, 3, 0.02)])
    assert chunk_times(result, 1) == pytest.approx([0.03, 0.04, 0.05])


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    sim = constant_step_simulation(config(max_num_batched_tokens=128), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(300, 2)])  # 128 + 128 + 44 tokens: 3 steps
    assert chunk_times(result, 0) == pytest.approx([0.03, 0.04])


def test_closed_loop_sends_the_next_request_when_one_ends():
    delays = ServingOverheads(request_s=0.001, token_s=0.001)
    sim = constant_step_simulation(config(overheads=delays), STEP_S)
    result = sim.run_level(LoadLevel(concurrency=1), [spec(10, 2), spec(10, 2), spec(10, 2)])
    # each: sent, +1 ms to the engine, two 10 ms steps, +1 ms to the client = 22 ms, back to back
    starts = sorted(r.start_s for r in result.records)
    assert starts == pytest.approx([0.0, 0.022, 0.044]) and result.wall_time_s == pytest.approx(0.066)
    assert result.e2e.p50_ms == pytest.approx(22.0)


def test_server_answers_429_beyond_its_waiting_bound():
    sim = constant_step_simulation(config(max_waiting_requests=1), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(10, 4), spec(10, 4), spec(10, 4)])
    # the first is scheduled at once; the second waits for the step in flight; the third is refused
    assert result.num_ok == 2 and result.num_failed == 1 and result.num_rate_limited == 1
    assert "HTTP 429" in result.error_samples[0]


def test_prompt_beyond_the_context_window_is_a_400():
    sim = constant_step_simulation(config(max_model_len=64), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(64, 4), spec(10, 4)])
    assert result.num_ok == 1 and result.num_failed == 1
    assert "HTTP 400" in result.error_samples[0] and "context window is 64" in result.error_samples[0]


def test_output_stops_at_the_context_window():
    sim = constant_step_simulation(config(max_model_len=64), STEP_S)
    result = sim.run_level(LoadLevel(None, 1.0), [spec(60, 50)])
    assert result.total_output_tokens == 4  # 60 + 4 = 64 tokens fill the window


def test_levels_run_one_after_another_each_from_zero():
    sim = constant_step_simulation(config(), STEP_S)
    first = sim.run_level(LoadLevel(None, 1.0), [spec(10, 3)])
    second = sim.run_level(LoadLevel(None, 1.0), [spec(10, 3)])
    assert chunk_times(first, 0) == pytest.approx([0.01, 0.02, 0.03])
    assert chunk_times(second, 0) == pytest.approx([0.01, 0.02, 0.03])
    assert sim.replicas[0].step == 6
