"""Disaggregated prefill and decode pools: the KV transfer, each pool's queue by hand, and when
separating them pays (long prompts under a tight TPOT) or loses (short prompts)."""
from __future__ import annotations

import math

import pytest

from shardserve.bench.stats import SLO
from shardserve.config import ParallelConfig
from shardserve.planner.cost_model import Deployment, decode_step_time, prefill_time
from shardserve.planner.disaggregation import (
    compare, decode_tpot_s, kv_transfer_s, plan_disaggregated, prefill_ttft_s,
)
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.planner.replica_model import ReplicaModel, Workload
from shardserve.planner.search import search

H100 = get_hardware("h100")
LLAMA8B = preset("llama-3.1-8b")
LLAMA70B = preset("llama-3.1-70b")


def test_kv_transfer_sends_every_layer_over_the_nic_from_every_rank():
    dep = Deployment(LLAMA8B, ParallelConfig(tp_size=2), H100)
    kv_bytes = 1000 * 32 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x kv heads x head_dim x bf16
    assert kv_transfer_s(dep, 1000) == pytest.approx(5e-6 + kv_bytes / (2 * 50e9 * 0.7))
    # DeepSeek's latent is one copy, not one per head: 70x fewer bytes than 70B's GQA cache per token
    deepseek = Deployment(preset("deepseek-v3"), ParallelConfig(tp_size=8), get_hardware("h200"), "float8")
    assert deepseek.model.kv_bytes_per_token(1) * 4.6 < LLAMA70B.kv_bytes_per_token(1)


def test_a_prefill_replica_is_an_md1_queue_plus_the_transfer():
    dep = Deployment(LLAMA8B, ParallelConfig(), H100)
    replica = ReplicaModel(dep, input_len=4096, output_len=256, max_num_seqs=100)  # one prompt, in 2 chunks
    t_p = replica.prefill_s
    assert t_p > prefill_time(dep, 4096).total_s
    assert prefill_ttft_s(replica, 0.5 / t_p, 0.01) == pytest.approx(0.5 * t_p / (2 * 0.5) + t_p + 0.01)
    assert prefill_ttft_s(replica, 1.01 / t_p, 0.0) == math.inf  # the prompts saturate it
    assert prefill_ttft_s(replica, 0.1 / t_p, 20 * t_p) == math.inf  # the link cannot keep up


def test_a_decode_replica_never_waits_for_a_prompt():
    dep = Deployment(LLAMA8B, ParallelConfig(), H100)
    replica = ReplicaModel(dep, input_len=512, output_len=128, max_num_seqs=1000)
    tpot = decode_tpot_s(replica, 8.0)
    n = 8.0 * 127 * tpot  # Little's law
    assert tpot == pytest.approx(decode_step_time(dep, n, 512 + 64).total_s, rel=1e-3)
    # co-located, the same traffic waits for prompt steps: TPOT = t_decode / (1 - rho)
    assert replica.predict(8.0).tpot_s > tpot * 1.05
    assert decode_tpot_s(ReplicaModel(dep, 512, 128, max_num_seqs=4), 8.0) == math.inf  # its KV cannot hold them


def test_pools_are_sized_apart_and_priced_against_the_best_colocated_replica():
    devices = [(H100, Efficiency())]
    long_prompts = Workload(8000, 256, qps=4.0)
    slo = SLO(ttft_ms=3000, tpot_ms=40)
    disagg = plan_disaggregated(LLAMA70B, devices, long_prompts, slo, "float8")
    for pool, latency_ms, target in ((disagg.prefill, disagg.ttft_ms, 3000), (disagg.decode, disagg.tpot_ms, 40)):
        assert pool.replicas == math.ceil(4.0 / pool.capacity_qps) and latency_ms <= target
    assert disagg.total_gpus == disagg.prefill.gpus + disagg.decode.gpus
    cost_per_hour = disagg.total_gpus * H100.price_per_hour_usd
    assert disagg.cost_per_million_tokens == pytest.approx(cost_per_hour / (4.0 * 256 * 3600) * 1e6)
    colocated = search(LLAMA70B, devices, long_prompts, slo, "float8").best
    # 8000-token prompts under a 40 ms TPOT: a co-located replica spends much of its time on prompts
    assert disagg.cost_per_million_tokens < colocated.cost_per_million_tokens
    assert "cheaper than co-located" in compare(disagg, colocated)
    short_prompts = Workload(128, 1024, qps=4.0)
    disagg = plan_disaggregated(LLAMA70B, devices, short_prompts, slo, "float8")
    colocated = search(LLAMA70B, devices, short_prompts, slo, "float8").best
    verdict = compare(disagg, colocated)
    assert "dearer than co-located" in verdict and "prompts take only" in verdict, verdict
    assert colocated.prefill_share < 0.2
