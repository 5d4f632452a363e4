"""Workload generators: lengths, arrivals, prompts, traces; distributions checked by their moments."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from shardserve.sim.workload import (
    RequestSpec, WorkloadConfig, build_workload, closed_loop_arrivals, gamma_arrivals, load_trace_jsonl,
    poisson_arrivals, random_lengths, sharegpt_like_lengths, synthesize_prompt_ids,
)


def test_random_lengths_fixed_when_ratio_is_zero():
    assert random_lengths(5, 32, 16, 0.0, seed=3) == [(32, 16)] * 5


def test_random_lengths_stay_in_range_and_center():
    pairs = np.array(random_lengths(20000, 100, 50, 0.5, seed=1))
    assert pairs[:, 0].min() >= 50 and pairs[:, 0].max() <= 150
    assert pairs[:, 1].min() >= 25 and pairs[:, 1].max() <= 75
    assert abs(pairs[:, 0].mean() - 100) < 2 and abs(pairs[:, 1].mean() - 50) < 1
    assert pairs[:, 0].min() == 50 and pairs[:, 0].max() == 150  # both ends reachable


def test_random_lengths_reproducible_by_seed():
    assert random_lengths(50, 64, 64, 0.9, seed=7) == random_lengths(50, 64, 64, 0.9, seed=7)
    assert random_lengths(50, 64, 64, 0.9, seed=7) != random_lengths(50, 64, 64, 0.9, seed=8)


@pytest.mark.parametrize("kwargs", [dict(input_len=0), dict(output_len=0), dict(range_ratio=1.0),
                                    dict(range_ratio=-0.1), dict(num=-1)])
def test_random_lengths_rejects_bad_arguments(kwargs):
    args = dict(num=3, input_len=8, output_len=8, range_ratio=0.0) | kwargs
    with pytest.raises(ValueError):
        random_lengths(**args)


def test_sharegpt_like_lengths_bounds_skew_and_means():
    pairs = np.array(sharegpt_like_lengths(40000, seed=0))
    prompt, output = pairs[:, 0], pairs[:, 1]
    assert prompt.min() >= 4 and prompt.max() <= 2048 and output.min() >= 4 and output.max() <= 1024
    # documented targets: means ~157 / ~313 after clipping, medians ~78 / ~226, right-skewed
    assert 140 < prompt.mean() < 175 and 290 < output.mean() < 335
    assert np.median(prompt) < prompt.mean() and np.median(output) < output.mean()
    assert sharegpt_like_lengths(10, seed=4) == sharegpt_like_lengths(10, seed=4)


def test_poisson_gaps_are_exponential():
    # P(gap > t) = e^(-rate t): at 5 req/s, e^-1 beyond the mean gap of 0.2 s, e^-3 beyond 0.6 s
    gaps_s = np.diff(poisson_arrivals(40001, 5.0, seed=2))
    assert gaps_s.mean() == pytest.approx(0.2, rel=0.02)
    assert [(gaps_s > t).mean() for t in (0.2, 0.6)] == pytest.approx([math.exp(-1), math.exp(-3)], abs=0.008)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_rate_and_coefficient_of_variation(burstiness):
    arrivals_s = np.array(gamma_arrivals(40001, rate_qps=8.0, burstiness=burstiness, seed=11))
    assert arrivals_s[0] == 0.0 and np.all(np.diff(arrivals_s) >= 0)
    gaps_s = np.diff(arrivals_s)
    assert gaps_s.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps_s.std() / gaps_s.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_gamma_arrivals_edge_cases():
    assert gamma_arrivals(0, 1.0) == []
    assert gamma_arrivals(1, 1.0) == [0.0]
    assert gamma_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in (dict(rate_qps=0.0), dict(rate_qps=-1.0), dict(burstiness=0.0), dict(burstiness=math.inf)):
        with pytest.raises(ValueError):
            gamma_arrivals(3, **(dict(rate_qps=1.0, burstiness=1.0) | bad))


def test_closed_loop_arrivals():
    assert closed_loop_arrivals(3) == [0.0, 0.0, 0.0]


def test_synthesized_prompts_have_lengths_range_and_determinism():
    prompts = synthesize_prompt_ids([3, 50, 1], seed=5)
    assert [len(p) for p in prompts] == [3, 50, 1]
    assert all(100 <= t < 40000 for p in prompts for t in p)
    assert prompts == synthesize_prompt_ids([3, 50, 1], seed=5)
    assert prompts != synthesize_prompt_ids([3, 50, 1], seed=6)
    assert all(10 <= t < 12 for t in synthesize_prompt_ids([100], vocab_range=(10, 12))[0])
    with pytest.raises(ValueError):
        synthesize_prompt_ids([3], vocab_range=(5, 5))


def _write_lines(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace_jsonl_reads_text_ids_and_arrivals(tmp_path):
    path = _write_lines(tmp_path, [
        json.dumps({"prompt": "hello", "output_len": 4}),
        "",
        json.dumps({"prompt": [5, 6, 7], "output_len": 2, "arrival_time_s": 1.5}),
    ])
    specs = load_trace_jsonl(path)
    assert specs == [RequestSpec(None, "hello", 4, 0.0), RequestSpec((5, 6, 7), None, 2, 1.5)]
    assert specs[0].prompt == "hello" and specs[1].prompt == [5, 6, 7]
    assert specs[0].prompt_len is None and specs[1].prompt_len == 3


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"prompt": "x"}), "output_len"),
    (json.dumps({"prompt": "x", "output_len": 0}), "output_len"),
    (json.dumps({"prompt": "x", "output_len": True}), "output_len"),
    (json.dumps({"prompt": "", "output_len": 3}), "prompt"),
    (json.dumps({"prompt": [1, "a"], "output_len": 3}), "prompt"),
    (json.dumps({"prompt": [], "output_len": 3}), "prompt"),
    (json.dumps({"prompt": "x", "output_len": 3, "arrival_time_s": -1}), "arrival_time_s"),
])
def test_load_trace_jsonl_names_the_bad_line(tmp_path, bad_line, message):
    path = _write_lines(tmp_path, [json.dumps({"prompt": "ok", "output_len": 1}), bad_line])
    with pytest.raises(ValueError, match=rf"trace.jsonl:2: .*{message}"):
        load_trace_jsonl(path)


def test_load_trace_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_trace_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no requests"):
        load_trace_jsonl(_write_lines(tmp_path, [""]))


def test_build_workload_random_closed_loop():
    specs = build_workload(WorkloadConfig(num_requests=6, input_len=16, output_len=8, seed=1))
    assert len(specs) == 6
    assert all(s.prompt_len == 16 and s.output_len == 8 and s.arrival_time_s == 0.0 for s in specs)
    assert len({s.prompt_token_ids for s in specs}) == 6  # distinct prompts: no accidental prefix hits
    assert specs == build_workload(WorkloadConfig(num_requests=6, input_len=16, output_len=8, seed=1))


def test_build_workload_rate_changes_only_arrivals():
    closed = build_workload(WorkloadConfig(num_requests=20, dataset="sharegpt", seed=3))
    opened = build_workload(WorkloadConfig(num_requests=20, dataset="sharegpt", seed=3, request_rate_qps=4.0))
    assert [s.prompt_token_ids for s in closed] == [s.prompt_token_ids for s in opened]
    assert [s.output_len for s in closed] == [s.output_len for s in opened]
    arrivals_s = [s.arrival_time_s for s in opened]
    assert arrivals_s[0] == 0.0 and arrivals_s == sorted(arrivals_s) and arrivals_s[-1] > 0


def test_build_workload_jsonl_keeps_or_replaces_trace_arrivals(tmp_path):
    lines = [json.dumps({"prompt": [i + 1], "output_len": 2, "arrival_time_s": 10.0 + i}) for i in range(5)]
    path = _write_lines(tmp_path, lines)
    kept = build_workload(WorkloadConfig(num_requests=3, dataset=f"jsonl:{path}"))
    assert [s.arrival_time_s for s in kept] == [10.0, 11.0, 12.0]
    replaced = build_workload(WorkloadConfig(num_requests=100, dataset=f"jsonl:{path}", request_rate_qps=1.0))
    assert len(replaced) == 5 and replaced[0].arrival_time_s == 0.0


def test_build_workload_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_workload(WorkloadConfig(num_requests=2, dataset="alpaca"))


def test_prompt_salt_changes_token_ids_not_lengths():
    base = WorkloadConfig(num_requests=5, input_len=12, output_len=4, range_ratio=0.5, seed=2)
    salted = build_workload(dataclasses.replace(base, prompt_salt=1))
    plain = build_workload(base)
    assert [(s.prompt_len, s.output_len) for s in plain] == [(s.prompt_len, s.output_len) for s in salted]
    assert not {s.prompt_token_ids for s in plain} & {s.prompt_token_ids for s in salted}
