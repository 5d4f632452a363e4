"""Planner search on small cases whose optimum is known or checked by exhaustion."""
from __future__ import annotations

import dataclasses
import math

import pytest

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError, ParallelConfig
from shardserve.planner.cost_model import Deployment
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import apply_what_if, get_hardware
from shardserve.planner.memory_fit import max_batch_tokens, max_num_seqs_that_fit
from shardserve.planner.model_presets import preset
from shardserve.planner.replica_model import ReplicaModel, Workload
from shardserve.planner.search import SearchSpace, _recommended_max_num_seqs, candidate_layouts, search

LLAMA8B = preset("llama-3.1-8b")  # 16.1 GB of bf16 weights
LLAMA70B = preset("llama-3.1-70b")
MIXTRAL = preset("mixtral-8x7b")
H100 = get_hardware("h100")
LOOSE = SLO(ttft_ms=5000, tpot_ms=500)


def on(*devices):
    return [(hw, Efficiency()) for hw in devices]


def test_candidate_layouts_are_the_engines_valid_powers_of_two():
    dense = candidate_layouts(LLAMA70B, H100, max_nodes_per_replica=2)
    assert all(p.ep_size == 1 and p.world_size <= 16 for p in dense)
    assert {(p.tp_size, p.pp_size) for p in dense} >= {(1, 1), (8, 1), (8, 2), (16, 1), (1, 16)}
    moe = {(p.tp_size, p.pp_size, p.ep_size) for p in candidate_layouts(MIXTRAL, H100, 1)}
    assert (1, 1, 8) in moe and (2, 1, 8) in moe and (8, 1, 8) in moe
    assert (4, 1, 2) not in moe  # tp must divide ep
    assert (1, 1, 16) not in moe  # 16 does not divide 8 experts


def test_a_model_too_big_for_one_device_gets_two():
    small = dataclasses.replace(H100, name="H100 12GB", memory_bytes=12_000_000_000)
    plan = search(LLAMA8B, on(small), Workload(512, 128, 0.2), LOOSE)
    single = [r for r in plan.rows if r.gpus_per_replica == 1]
    assert single and not any(r.fits for r in single)
    assert plan.best is not None and plan.best.gpus_per_replica == 2 and plan.best.total_gpus == 2
    assert all(r.gpus_per_replica >= 2 for r in plan.rows if r.feasible)


def test_the_cheaper_device_wins():
    cheap = dataclasses.replace(H100, name="H100 cheap", price_per_hour_usd=2.0)
    plan = search(LLAMA8B, on(H100, cheap), Workload(512, 128, 2.0), LOOSE)
    assert plan.best.hardware == "H100 cheap"
    twin = next(r for r in plan.rows if r.hardware == "H100 SXM" and r.layout == plan.best.layout)
    assert twin.replicas == plan.best.replicas
    assert plan.best.cost_per_million_tokens == pytest.approx(twin.cost_per_million_tokens / 2)


def _only_tp1(hw):
    return dataclasses.replace(hw, devices_per_node=1)  # with one node per replica: only tp1 pp1


def test_a_tighter_slo_forces_more_replicas_and_the_count_is_minimal():
    hw, workload = _only_tp1(H100), Workload(1024, 256, 20.0)
    space = SearchSpace(max_nodes_per_replica=1)
    loose = search(LLAMA8B, on(hw), workload, LOOSE, space=space).best
    tight_slo = SLO(ttft_ms=5000, tpot_ms=0.85 * loose.tpot_ms)  # the loose plan misses it
    tight = search(LLAMA8B, on(hw), workload, tight_slo, space=space).best
    assert tight.replicas > loose.replicas
    assert loose.tpot_ms > tight_slo.tpot_ms >= tight.tpot_ms
    dep = Deployment(LLAMA8B, ParallelConfig(), hw)
    kv_seqs = max_num_seqs_that_fit(max_batch_tokens(LLAMA8B, dep.parallel, hw, 2), 1280)
    replica = ReplicaModel(dep, 1024, 256, kv_seqs)
    assert replica.predict(20.0 / tight.replicas).meets(tight_slo)
    assert not replica.predict(20.0 / (tight.replicas - 1)).meets(tight_slo)


def test_best_plan_is_the_cheapest_by_exhaustion():
    # every layout x every replica count up to the winner's GPU count: none cheaper meets the SLO
    workload, slo = Workload(1024, 256, 8.0), SLO(ttft_ms=1500, tpot_ms=60)
    best = search(LLAMA70B, on(H100), workload, slo).best
    for par in candidate_layouts(LLAMA70B, H100, 2):
        dep = Deployment(LLAMA70B, par, H100)
        kv_seqs = max_num_seqs_that_fit(max_batch_tokens(LLAMA70B, par, H100, 2), 1280)
        if kv_seqs < 1:
            continue
        replica = ReplicaModel(dep, 1024, 256, kv_seqs)
        for replicas in range(1, best.total_gpus // par.world_size + 1):
            if replicas * par.world_size < best.total_gpus:
                assert not replica.predict(8.0 / replicas).meets(slo), (par, replicas)


def test_impossible_slo_and_gpu_budget_leave_nothing_feasible():
    plan = search(LLAMA8B, on(H100), Workload(512, 128, 1.0), SLO(tpot_ms=0.5))
    assert plan.best is None and not plan.pareto
    assert all("misses the SLO" in r.note or not r.fits for r in plan.rows)
    budget = search(LLAMA70B, on(H100), Workload(512, 128, 40.0), LOOSE, space=SearchSpace(max_total_gpus=2))
    assert budget.best is None
    assert any("budget" in r.note for r in budget.rows)


def test_rank_by_gpus_puts_the_fewest_gpus_first():
    plan = search(MIXTRAL, on(H100, get_hardware("h200")), Workload(1024, 256, 4.0), LOOSE,
                  space=SearchSpace(max_nodes_per_replica=1), rank_by="gpus")
    feasible = [r for r in plan.rows if r.feasible]
    assert [r.total_gpus for r in feasible] == sorted(r.total_gpus for r in feasible)
    assert plan.best.hardware == "H200" and plan.best.total_gpus == 1  # 93 GB fits one H200, not one H100
    with pytest.raises(ConfigError, match="rank-by"):
        search(MIXTRAL, on(H100), Workload(1024, 256, 4.0), LOOSE, rank_by="speed")


def test_pareto_front_trades_cost_for_latency():
    plan = search(LLAMA70B, on(H100), Workload(1024, 256, 10.0), SLO(ttft_ms=2000, tpot_ms=100))
    front = plan.pareto
    assert len(front) >= 3 and front[0].cost_per_million_tokens == plan.best.cost_per_million_tokens
    assert all(a.cost_per_million_tokens <= b.cost_per_million_tokens and a.e2e_ms > b.e2e_ms
               for a, b in zip(front, front[1:]))
    # every feasible point is beaten or matched by the front
    for point in plan.points:
        assert any(f.cost_per_million_tokens <= point.cost_per_million_tokens and f.e2e_ms <= point.e2e_ms
                   for f in front)


def test_cost_counts_output_tokens_at_the_given_traffic():
    plan = search(LLAMA8B, on(H100), Workload(512, 128, 2.0), LOOSE)
    best = plan.best
    tokens_per_hour = 2.0 * 128 * 3600
    assert best.cost_per_million_tokens == pytest.approx(best.total_gpus * 4.0 / tokens_per_hour * 1e6)
    assert best.max_num_seqs >= best.mean_batch and best.max_num_seqs <= best.kv_capacity_seqs


def test_what_if_moves_the_plan_the_expected_way():
    workload, slo = Workload(1024, 512, 40.0), SLO(ttft_ms=2000, tpot_ms=50)
    base = search(LLAMA70B, on(H100), workload, slo)

    def same_layout(plan, row):
        return next(r for r in plan.rows if r.layout == row.layout)
    faster_memory = search(LLAMA70B, on(apply_what_if(H100, "mem_bw=2x")), workload, slo)
    # decode is memory-bound: the same replicas decode faster, so fewer of them serve the traffic
    twin = same_layout(faster_memory, base.best)
    assert twin.replicas < base.best.replicas
    assert faster_memory.best.cost_per_million_tokens < base.best.cost_per_million_tokens
    more_flops = search(LLAMA70B, on(apply_what_if(H100, "flops=2x")), workload, slo)
    assert same_layout(more_flops, base.best).ttft_ms < base.best.ttft_ms  # prefill is compute-bound
    half_price = search(LLAMA70B, on(apply_what_if(H100, "price=0.5x")), workload, slo)
    assert half_price.best.cost_per_million_tokens == pytest.approx(base.best.cost_per_million_tokens / 2)
    less_memory = search(LLAMA70B, on(apply_what_if(H100, "memory=0.5x")), workload, slo)
    assert sum(r.fits for r in less_memory.rows) < sum(r.fits for r in base.rows)
    assert math.isfinite(base.best.e2e_ms)


def test_devices_without_the_dtype_are_left_out_not_the_whole_search():
    no_fp8 = dataclasses.replace(H100, name="no-fp8", peak_flop_s={"bfloat16": H100.peak_flop_s["bfloat16"]})
    plan = search(LLAMA8B, on(_only_tp1(no_fp8), _only_tp1(H100)), Workload(512, 128, 1.0), LOOSE, dtype="float8",
                  space=SearchSpace(max_nodes_per_replica=1))
    assert {r.hardware for r in plan.rows} == {"H100 SXM"} and plan.best is not None
    assert plan.skipped == ("no-fp8 (no float8 path)",)
    with pytest.raises(ConfigError, match="no float8 peak"):  # no device has it: nothing to plan
        search(LLAMA8B, on(no_fp8), Workload(512, 128, 1.0), LOOSE, dtype="float8")


def test_recommended_max_num_seqs_fits_the_step_budget():
    """A mean batch of 1,000 with KV for 5,000 sequences: 1,000 + 3 sqrt(1,000) rounds up to 2,048,
    but a step of a 512-token budget carries at most 512 sequences."""
    assert _recommended_max_num_seqs(1000, 5000, 4096) == 2048
    assert _recommended_max_num_seqs(1000, 5000, 512) == 512
    assert _recommended_max_num_seqs(1000, 300, 512) == 300


def test_a_closed_loop_plan_is_one_replica_per_layout_at_the_rate_its_clients_reach():
    plan = search(LLAMA8B, on(_only_tp1(H100)), Workload(1024, 128, concurrency=64), LOOSE,
                  space=SearchSpace(max_nodes_per_replica=1))
    (row,) = plan.rows
    kv_seqs = max_num_seqs_that_fit(max_batch_tokens(LLAMA8B, ParallelConfig(), H100, 2, 0.9), 1152)
    expected = ReplicaModel(Deployment(LLAMA8B, ParallelConfig(), H100), 1024, 128, kv_seqs).predict_closed_loop(64)
    assert row.replicas == 1 and row.ttft_ms == pytest.approx(expected.ttft_s * 1e3)
    assert row.cost_per_million_tokens == pytest.approx(H100.price_per_hour_usd / (expected.arrival_qps * 128 * 3600) * 1e6)
    with pytest.raises(ConfigError, match="not both"):
        Workload(1024, 128, qps=1.0, concurrency=8)


def test_fp4_weights_keep_an_fp8_kv_cache_and_plan_on_the_devices_that_have_fp4():
    """Llama-3.1-405B in NVFP4 (4.5 bits a weight with its scales): 228 GB, more than one B200's
    180 GiB, so two at least; its KV stays one byte an element."""
    llama405 = preset("llama-3.1-405b")
    b200 = get_hardware("b200")
    assert 405e9 < llama405.num_params < 406e9
    dep = Deployment(llama405, ParallelConfig(tp_size=2), b200, "float4")
    assert dep.dtype_bytes == 0.5625 and dep.kv_bytes == 1
    weights = math.ceil(llama405.num_params * 0.5625 / 2)  # per rank, roughly: embeddings split too
    kv_tokens = max_batch_tokens(llama405, ParallelConfig(tp_size=2), b200, 0.5625, 0.9, kv_bytes=1)
    per_token = 126 * 2 * 8 * 128 // 2  # K and V, 8 KV heads of 128 over 2 ranks, one byte each
    assert kv_tokens == pytest.approx((180 * 2**30 * 0.9 - weights) / per_token, rel=0.01)
    plan = search(llama405, on(b200, H100), Workload(1024, 256, 2.0), LOOSE, dtype="float4")
    assert plan.best is not None and plan.best.gpus_per_replica >= 2 and plan.skipped == ("H100 SXM (no float4 path)",)
