"""Disaggregated prefill and decode: a pool of replicas that only prefill, a pool that only
decodes, and each request's KV cache sent from the first to the second, planned pool by pool.

A prefill replica runs nothing but prompts, packed k to a step under the token budget
(ReplicaModel.packed_prefill, t_k per step). At lam_p requests/s it is an M/D/1 server (G/D/1
for gamma arrivals, c2 as in replica_model) of utilization rho_p = lam_p t_k / k, and the
first token comes after

    TTFT = c2 rho_p t_k / (2 (1 - rho_p)) + t_k + transfer

where transfer = latency + KV bytes / (sending ranks x link bandwidth x network efficiency): the
prompt's KV (every layer; under MLA one copy of the latent) leaves over the inter-node link, each
rank of the prefill replica sending its own shard. The link itself must keep up: lam_p x transfer
< 1. A decode replica never stalls on a prompt (no prefill steps steal from it), so its TPOT is
its decode step at the batch Little's law gives, n = lam_d (O - 1) TPOT, up to what its KV cache
holds and what one step carries.

Pools are priced independently: P = ceil(qps / prefill capacity at the TTFT target) replicas of
the cheapest prefill layout, D = ceil(qps / decode capacity at the TPOT target) of the cheapest
decode layout (the cost is a sum of one term per pool, so choosing each pool alone is optimal).
`compare` says whether that beats the best co-located replica and why not when it does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError, ModelConfig
from shardserve.planner.cost_model import Deployment, decode_step_time
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import Hardware
from shardserve.planner.replica_model import ReplicaModel, Workload, highest_rate
from shardserve.planner.search import PlanRow, SearchSpace, candidate_layouts, kv_capacity_seqs, layout_label

_MAX_ITERATIONS = 200


def kv_transfer_s(dep: Deployment, prompt_len: int) -> float:
    """Seconds to send one prompt's KV from a prefill replica of `dep`'s layout to a decode
    replica on another node: every layer's cache, each sending rank its share in parallel (a
    replicated MLA latent is sent once, split over the ranks)."""
    model, hw = dep.model, dep.hardware
    total_bytes = prompt_len * model.kv_bytes_per_token(dep.kv_bytes)
    bandwidth = hw.inter_node_bandwidth_bytes_s * dep.efficiency.network * dep.world_size
    return hw.inter_node_latency_s + total_bytes / bandwidth


@dataclass(frozen=True)
class PoolOption:
    """One pool's layout and how many replicas of it the traffic needs."""

    deployment: Deployment
    replicas: int
    capacity_qps: float  # one replica's, at the pool's SLO target
    latency_s: float  # TTFT (prefill pool) or TPOT (decode pool) at qps / replicas
    qps: float  # the whole pool's traffic

    @property
    def gpus(self) -> int:
        return self.replicas * self.deployment.world_size

    @property
    def utilization(self) -> float:
        """Traffic over what the pool's replicas take at the SLO."""
        return self.qps / (self.replicas * self.capacity_qps)

    @property
    def layout(self) -> str:
        return f"{self.deployment.hardware.name} {layout_label(self.deployment.parallel)}"


@dataclass(frozen=True)
class DisaggregatedPlan:
    prefill: PoolOption
    decode: PoolOption
    kv_transfer_ms: float
    cost_per_million_tokens: float
    ttft_ms: float
    tpot_ms: float

    @property
    def total_gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    def summary(self) -> str:
        return (f"prefill {self.prefill.layout} x{self.prefill.replicas} + decode {self.decode.layout} "
                f"x{self.decode.replicas} (P:D {self.prefill.replicas}:{self.decode.replicas}), "
                f"{self.total_gpus} GPUs, ${self.cost_per_million_tokens:.2f}/1M tok, TTFT {self.ttft_ms:,.0f} ms "
                f"(KV transfer {self.kv_transfer_ms:.1f} ms), TPOT {self.tpot_ms:.1f} ms")


def prefill_ttft_s(replica: ReplicaModel, arrival_qps: float, transfer_s: float) -> float:
    """Mean TTFT of a prefill-only replica at `arrival_qps` (inf when it or its link saturates)."""
    k, step_s = replica.packed_prefill(arrival_qps)
    rho = arrival_qps * step_s / k
    if rho >= 1 or arrival_qps * transfer_s >= 1:
        return math.inf
    return replica.arrival_cv2 * rho * step_s / (2 * (1 - rho)) + step_s + transfer_s


def decode_tpot_s(replica: ReplicaModel, arrival_qps: float) -> float:
    """Mean TPOT of a decode-only replica at `arrival_qps`: the fixed point of Little's law and
    the decode step (inf past what its KV cache or one step carries)."""
    max_running = min(replica.max_num_seqs, replica.max_num_batched_tokens)
    context_len = replica.input_len + replica.output_len / 2
    n = 0.0
    for _ in range(_MAX_ITERATIONS):
        step_s = decode_step_time(replica.deployment, n, context_len).total_s
        next_n = arrival_qps * (replica.output_len - 1) * step_s
        if next_n > max_running:
            return math.inf
        if abs(next_n - n) <= 1e-4 * max(1.0, next_n):
            return decode_step_time(replica.deployment, next_n, context_len).total_s
        n = next_n
    return math.inf


def _pool(dep: Deployment, qps: float, capacity: float, latency) -> PoolOption | None:
    if capacity <= 0:
        return None
    replicas = max(1, math.ceil(qps / capacity))
    return PoolOption(dep, replicas, capacity, latency(qps / replicas), qps)


def plan_disaggregated(model: ModelConfig, devices: list[tuple[Hardware, Efficiency]], workload: Workload,
                       slo: SLO, dtype: str = "bfloat16", space: SearchSpace = SearchSpace()) -> DisaggregatedPlan | None:
    """The cheapest prefill pool meeting slo.ttft_ms and decode pool meeting slo.tpot_ms for
    `workload` (an arrival rate, `qps`), over every layout of every device; None when either pool
    has no layout that fits and keeps up."""
    if workload.qps is None:
        return None
    qps = workload.qps
    ttft_target = slo.ttft_ms / 1e3 if slo.ttft_ms is not None else math.inf
    tpot_target = slo.tpot_ms / 1e3 if slo.tpot_ms is not None else math.inf
    best: dict[str, PoolOption] = {}
    for hw, efficiency in devices:
        if dtype not in hw.peak_flop_s or hw.inter_node_bandwidth_bytes_s <= 0:
            continue
        for par in candidate_layouts(model, hw, space.max_nodes_per_replica):
            try:
                pools = _pools(Deployment(model, par, hw, dtype, efficiency), workload, space, ttft_target, tpot_target)
            except ConfigError:  # e.g. a measured host without the links this layout needs
                continue
            for name, pool in pools.items():
                if pool is not None and (name not in best or _cost(pool) < _cost(best[name])):
                    best[name] = pool
    if len(best) < 2:
        return None
    prefill, decode = best["prefill"], best["decode"]
    cost_per_hour = _cost(prefill) + _cost(decode)
    return DisaggregatedPlan(
        prefill=prefill, decode=decode, kv_transfer_ms=kv_transfer_s(prefill.deployment, workload.input_len) * 1e3,
        cost_per_million_tokens=cost_per_hour / (qps * workload.output_len * 3600) * 1e6,
        ttft_ms=prefill.latency_s * 1e3, tpot_ms=decode.latency_s * 1e3)


def _pools(dep: Deployment, workload: Workload, space: SearchSpace, ttft_target: float,
           tpot_target: float) -> dict[str, PoolOption | None]:
    """This layout as a prefill pool and as a decode pool (None where it fits no sequence or
    misses the target at any rate)."""
    kv_seqs = kv_capacity_seqs(dep, workload, space)
    if kv_seqs < 1:
        return {}
    replica = ReplicaModel(dep, workload.input_len, workload.output_len, kv_seqs, space.max_num_batched_tokens,
                           workload.arrival_cv2)
    transfer_s = kv_transfer_s(dep, workload.input_len)

    def ttft(rate: float) -> float:
        return prefill_ttft_s(replica, rate, transfer_s)

    def tpot(rate: float) -> float:
        return decode_tpot_s(replica, rate)

    # no decode rate is stable past n = lam (O - 1) t_decode(1) at the largest batch a step carries
    decode_hi = min(kv_seqs, space.max_num_batched_tokens) / (
        max(1, workload.output_len - 1) * decode_step_time(dep, 1, workload.input_len).total_s)
    qps = workload.qps
    return {"prefill": _pool(dep, qps, highest_rate(lambda r: ttft(r) <= ttft_target,
                                                    replica.prefill_saturation_qps()), ttft),
            "decode": _pool(dep, qps, highest_rate(lambda r: tpot(r) <= tpot_target, decode_hi), tpot)}


def _cost(pool: PoolOption) -> float:
    return pool.gpus * pool.deployment.hardware.price_per_hour_usd


def compare(disaggregated: DisaggregatedPlan | None, colocated: PlanRow | None) -> str:
    """One line: which wins on cost per million tokens, and why the loser loses."""
    if disaggregated is None:
        return "disaggregated: no prefill or decode pool fits and meets its target"
    line = f"disaggregated: {disaggregated.summary()}"
    if colocated is None:
        return line + "; no co-located deployment meets the SLO, so disaggregation is the plan"
    saving = 1 - disaggregated.cost_per_million_tokens / colocated.cost_per_million_tokens
    other = (f"co-located {colocated.hardware} {colocated.layout} x{colocated.replicas} "
             f"(TPOT {colocated.tpot_ms:.1f} ms with prompts sharing its steps)")
    if abs(saving) < 0.005:
        return line + f"; the same cost as {other}"
    if saving > 0:
        return line + f"; {saving:.0%} cheaper than {other}"
    reasons = []
    if colocated.prefill_share < 0.2:
        reasons.append(f"prompts take only {colocated.prefill_share:.0%} of a co-located replica's time, "
                       "so a decode pool free of them gains little")
    idle = [f"{name} pool at {pool.utilization:.0%} of its capacity"
            for name, pool in (("prefill", disaggregated.prefill), ("decode", disaggregated.decode))
            if pool.utilization < 0.7]
    if idle:
        reasons.append("whole replicas per pool leave the " + " and the ".join(idle))
    if disaggregated.kv_transfer_ms > 0.1 * disaggregated.ttft_ms:
        reasons.append(f"the KV transfer ({disaggregated.kv_transfer_ms:.1f} ms) is "
                       f"{disaggregated.kv_transfer_ms / disaggregated.ttft_ms:.0%} of the TTFT")
    why = "; ".join(reasons) or "two pools cost more GPU-hours than one that shares its steps"
    return line + f"; {-saving:.0%} dearer than {other}: {why}"
