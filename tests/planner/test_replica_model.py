"""Steady-state replica model: the M/D/1 prefill queue and Little's law, checked by hand."""
from __future__ import annotations

import math

import pytest

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError, ParallelConfig
from shardserve.planner.cost_model import Deployment, decode_step_time, prefill_time
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.planner.replica_model import ReplicaModel, Workload

LLAMA8B = Deployment(preset("llama-3.1-8b"), ParallelConfig(), get_hardware("h100"))


def test_prefill_only_traffic_is_an_md1_queue():
    # output_len 1: no decode steps, so the replica is a single deterministic server of prefills
    replica = ReplicaModel(LLAMA8B, input_len=1024, output_len=1, max_num_seqs=100)
    t_p = prefill_time(LLAMA8B, 1024).total_s
    assert replica.prefill_s == pytest.approx(t_p)
    pred = replica.predict(0.5 / t_p)  # rho = 0.5: Pollaczek-Khinchine wait = rho t_p / (2 (1 - rho))
    assert pred.stable and pred.num_running_seqs == 0 and pred.tpot_s == 0
    assert pred.ttft_s == pytest.approx(t_p + 0.5 * t_p / (2 * 0.5))
    assert not replica.predict(1.0 / t_p).stable  # rho = 1


def test_decode_batch_follows_littles_law():
    replica = ReplicaModel(LLAMA8B, input_len=512, output_len=128, max_num_seqs=1000)
    qps = 4.0
    pred = replica.predict(qps)
    rho = qps * replica.prefill_s
    assert pred.prefill_utilization == pytest.approx(rho)
    # n = lam (O - 1) TPOT, TPOT = decode step at n, mean context 512 + 64, over (1 - rho)
    step_s = decode_step_time(LLAMA8B, pred.num_running_seqs, 512 + 64).total_s
    assert pred.tpot_s == pytest.approx(step_s / (1 - rho))
    assert pred.num_running_seqs == pytest.approx(qps * 127 * pred.tpot_s, rel=1e-3)
    assert pred.e2e_s == pytest.approx(pred.ttft_s + 127 * pred.tpot_s)
    # at a trickle: TTFT is one prefill, TPOT one decode step of an almost empty batch
    idle = replica.predict(1e-6)
    assert idle.ttft_s == pytest.approx(replica.prefill_s, rel=1e-3)
    assert idle.tpot_s == pytest.approx(decode_step_time(LLAMA8B, 0, 576).total_s, rel=1e-3)


def test_kv_capacity_bounds_the_batch():
    roomy = ReplicaModel(LLAMA8B, input_len=512, output_len=512, max_num_seqs=10_000)
    cramped = ReplicaModel(LLAMA8B, input_len=512, output_len=512, max_num_seqs=8)
    pred = roomy.predict(2.0)
    assert pred.stable and pred.num_running_seqs > 8
    assert not cramped.predict(2.0).stable and math.isinf(cramped.predict(2.0).tpot_s)


def test_the_step_token_budget_bounds_the_batch_too():
    """Each running sequence takes one token of a step: with KV room for 10,000 sequences and a
    64-token budget, at most 63 decode beside a prefill chunk, whatever the traffic."""
    def replica(budget: int) -> ReplicaModel:
        return ReplicaModel(LLAMA8B, input_len=128, output_len=128, max_num_seqs=10_000, max_num_batched_tokens=budget)

    roomy = replica(1 << 20).predict(50.0)
    assert roomy.stable and roomy.num_running_seqs > 63  # what Little's law asks for at 50 req/s
    assert not replica(64).predict(50.0).stable  # more than a step carries: overload
    tight = replica(64)
    assert 0 < tight.predict(tight.capacity_qps(None)).num_running_seqs <= 63


def test_capacity_is_the_edge_of_the_slo():
    replica = ReplicaModel(LLAMA8B, input_len=1024, output_len=256, max_num_seqs=2000)
    slo = SLO(ttft_ms=1000, tpot_ms=40)
    capacity = replica.capacity_qps(slo)
    assert capacity > 0
    assert replica.predict(capacity).meets(slo)
    assert not replica.predict(capacity * 1.01).meets(slo)
    assert replica.capacity_qps(None) > capacity  # keeping up is easier than meeting the SLO
    assert replica.capacity_qps(SLO(tpot_ms=0.1)) == 0.0  # faster than one weight read


def test_chunked_prefill_takes_several_steps():
    one_step = ReplicaModel(LLAMA8B, input_len=4096, output_len=16, max_num_seqs=100, max_num_batched_tokens=8192)
    chunked = ReplicaModel(LLAMA8B, input_len=4096, output_len=16, max_num_seqs=100, max_num_batched_tokens=1024)
    # four 1024-token steps each re-read the weights and pay the step overhead
    assert chunked.prefill_s > one_step.prefill_s
    assert chunked.prefill_s < one_step.prefill_s + 4 * (decode_step_time(LLAMA8B, 0, 1).total_s)


def test_workload_validation():
    with pytest.raises(ConfigError, match="qps"):
        Workload(100, 10, 0)
    with pytest.raises(ConfigError, match="at least 1"):
        Workload(0, 10, 1)


def test_short_prompts_that_wait_together_are_prefilled_together():
    """128-token prompts under a 2,048-token budget: a step takes up to 16, sharing its weight
    read, so a replica takes many more prompts per second than one prefill at a time allows."""
    replica = ReplicaModel(LLAMA8B, input_len=128, output_len=1, max_num_seqs=1000)
    alone_s = prefill_time(LLAMA8B, 128).total_s
    assert replica.packed_prefill(1e-3) == (1, pytest.approx(alone_s))  # a trickle: one at a time
    rate = 2 / alone_s  # two arrive while one prefills alone
    k, step_s = replica.packed_prefill(rate)
    assert 2 <= k <= 16 and step_s == pytest.approx(prefill_time(LLAMA8B, 128, k).total_s)
    assert k == min(16, math.ceil(rate * step_s))  # the fixed point
    pred = replica.predict(rate)
    assert pred.stable and pred.prefill_utilization == pytest.approx(rate * step_s / k)
    assert replica.capacity_qps(None) > 2 / alone_s  # one-at-a-time prefill saturates at 1 / alone_s


def test_closed_loop_clients_arrive_in_waves_and_queue_behind_each_others_prefill():
    """64 clients, 1,024-token prompts, a 2,048-token budget: two prompts a prefill step, 32 steps
    a wave, so the mean client waits 16.5 of them for its first token (Poisson at the same rate
    would predict far less: the prompts do not arrive spread out)."""
    replica = ReplicaModel(LLAMA8B, input_len=1024, output_len=128, max_num_seqs=1000)
    t2 = prefill_time(LLAMA8B, 1024, 2).total_s
    tpot = decode_step_time(LLAMA8B, 64, 1024 + 64).total_s
    pred = replica.predict_closed_loop(64)
    assert pred.ttft_s == pytest.approx(t2 * 33 / 2)
    # the first group's tokens wait out the 31 prefill steps after it, the last group's none
    assert pred.tpot_s == pytest.approx(tpot + 31 * t2 / (2 * 127))
    assert pred.tpot_p99_s == pytest.approx(tpot + 31 * t2 / 127)
    assert pred.arrival_qps == pytest.approx(64 / (32 * t2 + 127 * tpot))
    assert pred.e2e_s == pytest.approx(32 * t2 + 127 * tpot)  # the wave's period, for every request
    assert pred.ttft_s > 3 * replica.predict(pred.arrival_qps).ttft_s
    # clients beyond the KV capacity wait out a whole wave
    small = ReplicaModel(LLAMA8B, input_len=1024, output_len=128, max_num_seqs=32)
    full, half = small.predict_closed_loop(64), small.predict_closed_loop(32)
    assert full.num_running_seqs == 32 and full.arrival_qps == pytest.approx(half.arrival_qps)
    period = 16 * t2 + 127 * decode_step_time(LLAMA8B, 32, 1024 + 64).total_s
    assert full.ttft_s == pytest.approx(half.ttft_s + period)


def test_an_offline_run_ends_with_its_last_smaller_wave():
    """80 requests queued at once, 32 a wave (the KV cache): waves of 32, 32 and 16. The last
    costs its 127 decode steps for half the tokens, so the run's throughput is below the steady
    state's; a request's TTFT counts the waves before its own."""
    replica = ReplicaModel(LLAMA8B, input_len=1024, output_len=128, max_num_seqs=32)
    t2 = prefill_time(LLAMA8B, 1024, 2).total_s
    period32 = 16 * t2 + 127 * decode_step_time(LLAMA8B, 32, 1024 + 64).total_s
    period16 = 8 * t2 + 127 * decode_step_time(LLAMA8B, 16, 1024 + 64).total_s
    pred = replica.predict_offline(80)
    assert pred.arrival_qps == pytest.approx(80 / (2 * period32 + period16))
    assert pred.arrival_qps < replica.predict_closed_loop(80).arrival_qps
    ttft32, ttft16 = t2 * 17 / 2, t2 * 9 / 2
    assert pred.ttft_s == pytest.approx((32 * ttft32 + 32 * (period32 + ttft32) + 16 * (2 * period32 + ttft16)) / 80)
    assert pred.ttft_p99_s == pytest.approx(2 * period32 + 8 * t2)  # the last wave's last prompts
    # whole waves only: the steady closed loop's throughput
    assert replica.predict_offline(64).arrival_qps == pytest.approx(replica.predict_closed_loop(32).arrival_qps)
    with pytest.raises(ConfigError):
        replica.predict_offline(0)


def test_gamma_arrivals_scale_the_prefill_wait_and_p99_follows_the_exponential_tail():
    # prefill only (output_len 1): G/D/1 wait = c2 rho t_p / (2 (1 - rho)), c2 = 1 / shape
    t_p = prefill_time(LLAMA8B, 1024).total_s
    poisson = ReplicaModel(LLAMA8B, input_len=1024, output_len=1, max_num_seqs=100).predict(0.5 / t_p)
    bursty = ReplicaModel(LLAMA8B, input_len=1024, output_len=1, max_num_seqs=100, arrival_cv2=4.0).predict(0.5 / t_p)
    assert poisson.ttft_s - t_p == pytest.approx(0.5 * t_p)
    assert bursty.ttft_s - t_p == pytest.approx(4 * 0.5 * t_p)
    # P(W > t) = rho exp(-rho t / W): W_99 = (W / rho) ln(rho / 0.01) = t_p ln 50 at rho 0.5
    assert poisson.ttft_p99_s == pytest.approx(t_p + t_p * math.log(50))
    # below rho = 0.01 the 99th percentile waits for nothing
    assert ReplicaModel(LLAMA8B, 1024, 1, 100).predict(0.005 / t_p).ttft_p99_s == pytest.approx(t_p)
    assert Workload(128, 16, qps=1.0, burstiness=0.25).arrival_cv2 == 4.0
    with pytest.raises(ConfigError, match="burstiness"):
        Workload(128, 16, qps=1.0, burstiness=0)


def test_tpot_p99_counts_the_prompts_that_arrive_during_a_decode():
    replica = ReplicaModel(LLAMA8B, input_len=512, output_len=128, max_num_seqs=1000)
    pred = replica.predict(4.0)
    step = decode_step_time(LLAMA8B, pred.num_running_seqs, 512 + 64).total_s
    meanwhile = 4.0 * 127 * pred.tpot_s  # prompts arriving during its 127 decode steps
    per_prompt = replica.prefill_s  # one prompt per prefill step at this rate
    assert replica.packed_prefill(4.0)[0] == 1
    assert pred.tpot_p99_s == pytest.approx(step + per_prompt * (meanwhile + 2.33 * math.sqrt(meanwhile)) / 127)
    assert pred.tpot_s < pred.tpot_p99_s and pred.ttft_s < pred.ttft_p99_s
    # the mean TPOT is the same count's mean: t_decode + t_p m / (O - 1)
    assert pred.tpot_s == pytest.approx(step + per_prompt * meanwhile / 127, rel=1e-3)
    slo = SLO(tpot_ms=(pred.tpot_s + pred.tpot_p99_s) / 2 * 1e3)
    assert pred.meets(slo) and not pred.meets(slo, tail=True)
