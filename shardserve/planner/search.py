"""Search deployments: hardware x (tp, pp, ep) x replicas x max batch, for a model and its traffic.

For each device and each layout the engine accepts (powers of two, at most
`max_nodes_per_replica` nodes per replica):
  1. memory: weights + KV per rank; the sequences of input_len + output_len tokens that fit;
  2. capacity: the highest arrival rate one replica takes while meeting the SLO (ReplicaModel);
  3. replicas = ceil(qps / capacity), each replica taking qps / replicas (an even router);
  4. max batch: the steady-state model gains nothing from a lower cap, so the plan recommends
     max_num_seqs = the smallest power of two >= n + 3 sqrt(n) (n = the mean running batch;
     room for Poisson bursts), capped by what fits;
  5. cost per million output tokens at this traffic (not at peak):
     replicas * gpus per replica * price per hour / (qps * output_len * 3600) * 1e6.
Rows are ranked feasible first (fits, meets the SLO, within the GPU budget), then by cost or by
GPU count. Extra replica counts (more replicas, lower latency) feed the cost/latency Pareto front.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError, ModelConfig, ParallelConfig
from shardserve.dtypes import dtype_bytes_of
from shardserve.planner.cost_model import Deployment
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import Hardware
from shardserve.planner.memory_fit import max_batch_tokens, max_num_seqs_that_fit
from shardserve.planner.replica_model import ReplicaModel, ReplicaPrediction, Workload

RANK_BY = ("cost", "gpus")


@dataclass(frozen=True)
class SearchSpace:
    """Bounds of the search, the engine settings the predictions assume, and whether the SLO
    bounds the means or the p99s."""

    max_nodes_per_replica: int = 2
    max_total_gpus: int | None = None  # the deployment's budget; None: unbounded
    max_num_batched_tokens: int = 2048  # the engine's per-step token budget (SchedulerConfig)
    mem_fraction: float = 0.9  # of device memory for weights + KV; the rest: activations, context
    block_size: int = 16
    slo_at_p99: bool = False


def layout_label(par: ParallelConfig) -> str:
    """How plans name a layout: "tp2 pp1 ep8", "tp1 pp1 ep8 dp-attn"."""
    return f"tp{par.tp_size} pp{par.pp_size} ep{par.ep_size}" + (" dp-attn" if par.dp_attention else "")


@dataclass(frozen=True)
class PlanRow:
    """One deployment: `replicas` copies of a (tp, pp, ep) layout on `hardware`. Latencies are
    predicted means at the planned traffic (inf when overloaded, nan when it does not fit)."""

    hardware: str
    tp: int
    pp: int
    ep: int
    gpus_per_replica: int
    replicas: int
    max_num_seqs: int  # recommended engine setting
    kv_capacity_seqs: int  # sequences of input_len + output_len whose KV fits
    mean_batch: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    cost_per_hour_usd: float
    cost_per_million_tokens: float  # output tokens, at the planned traffic
    fits: bool
    meets_slo: bool
    note: str  # why infeasible, or the decode bottleneck
    efficiency: str  # "uncalibrated" or where the factors came from
    dp_attention: bool = False
    prefill_share: float = math.nan  # of the replica's time spent on prompts (Poisson traffic)

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def feasible(self) -> bool:
        return self.fits and self.meets_slo and "budget" not in self.note

    @property
    def layout(self) -> str:
        return layout_label(ParallelConfig(self.tp, self.pp, self.ep, dp_attention=self.dp_attention))


@dataclass(frozen=True)
class Plan:
    """Ranked rows (one per hardware and layout, at its fewest replicas), every feasible point
    evaluated (for plots), and the Pareto front of cost vs mean end-to-end latency."""

    rows: tuple[PlanRow, ...]
    points: tuple[PlanRow, ...]
    pareto: tuple[PlanRow, ...]
    skipped: tuple[str, ...] = ()  # devices left out, and why (no path for the dtype)

    @property
    def best(self) -> PlanRow | None:
        return self.rows[0] if self.rows and self.rows[0].feasible else None


def candidate_layouts(model: ModelConfig, hw: Hardware, max_nodes_per_replica: int) -> list[ParallelConfig]:
    """Every (tp, pp, ep) in powers of two with world size <= devices per node * nodes that the
    engine's ParallelConfig.validate accepts (ep > 1 only for MoE models), and each ep > tp one
    also with data-parallel attention."""
    max_world = hw.devices_per_node * max_nodes_per_replica
    powers = [2**i for i in range(max_world.bit_length()) if 2**i <= max_world]
    layouts = []
    for tp in powers:
        for pp in powers:
            for ep in powers if model.is_moe else [1]:
                for dp_attention in (False, True) if ep > tp else (False,):
                    par = ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, dp_attention=dp_attention)
                    if par.world_size > max_world:
                        continue
                    try:
                        par.validate(model)
                    except ConfigError:
                        continue
                    layouts.append(par)
    return layouts


def _recommended_max_num_seqs(mean_batch: float, kv_capacity_seqs: int, step_budget: int) -> int:
    """A power of two above the mean batch plus its Poisson spread, within what the KV cache
    holds and what one step's token budget carries (one token per running sequence)."""
    wanted = max(1, math.ceil(mean_batch + 3 * math.sqrt(mean_batch)))
    return min(kv_capacity_seqs, step_budget, 1 << (wanted - 1).bit_length())


def _row(dep: Deployment, workload: Workload, replicas: int, pred: ReplicaPrediction | None,
         kv_capacity_seqs: int, meets_slo: bool, note: str, step_budget: int) -> PlanRow:
    par, hw = dep.parallel, dep.hardware
    cost_per_hour = replicas * par.world_size * hw.price_per_hour_usd
    if pred is None:
        ttft_ms = tpot_ms = e2e_ms = ttft_p99_ms = tpot_p99_ms = batch = prefill_share = math.nan
        cost_per_m, max_seqs = math.inf, 0
    else:
        ttft_ms, tpot_ms, e2e_ms = pred.ttft_s * 1e3, pred.tpot_s * 1e3, pred.e2e_s * 1e3
        ttft_p99_ms, tpot_p99_ms = pred.ttft_p99_s * 1e3, pred.tpot_p99_s * 1e3
        batch, prefill_share = pred.num_running_seqs, pred.prefill_utilization
        served_qps = pred.arrival_qps * replicas  # the workload's rate, or what a closed loop reaches
        cost_per_m = cost_per_hour / (served_qps * workload.output_len * 3600) * 1e6
        max_seqs = (_recommended_max_num_seqs(batch, kv_capacity_seqs, step_budget) if pred.stable
                    else min(kv_capacity_seqs, step_budget))
    return PlanRow(
        hardware=hw.name, tp=par.tp_size, pp=par.pp_size, ep=par.ep_size, gpus_per_replica=par.world_size,
        replicas=replicas, max_num_seqs=max_seqs, kv_capacity_seqs=kv_capacity_seqs, mean_batch=batch,
        ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms, ttft_p99_ms=ttft_p99_ms, tpot_p99_ms=tpot_p99_ms,
        cost_per_hour_usd=cost_per_hour,
        cost_per_million_tokens=cost_per_m, fits=pred is not None, meets_slo=meets_slo, note=note,
        efficiency=dep.efficiency.label, dp_attention=par.dp_attention, prefill_share=prefill_share,
    )


def _fewest_replicas(replica: ReplicaModel, qps: float, slo: SLO | None, capacity_qps: float, tail: bool) -> int:
    replicas = max(1, math.ceil(qps / capacity_qps))
    # the capacity is a bisection estimate: step up past its tolerance if needed
    while not replica.predict(qps / replicas).meets(slo, tail) and replicas < 2 * math.ceil(qps / capacity_qps) + 2:
        replicas += 1
    return replicas


def kv_capacity_seqs(dep: Deployment, workload: Workload, space: SearchSpace) -> int:
    """Sequences of the workload's isl + osl tokens whose KV one replica of `dep` holds."""
    kv_tokens = max_batch_tokens(dep.model, dep.parallel, dep.hardware, dep.weight_bytes, space.mem_fraction,
                                 dep.kv_bytes)
    return max_num_seqs_that_fit(kv_tokens, workload.input_len + workload.output_len, space.block_size)


def plan_layout(dep: Deployment, workload: Workload, slo: SLO, space: SearchSpace) -> list[PlanRow]:
    """Rows for one layout: first the fewest replicas (the ranked row), then larger counts
    (Pareto candidates). One row with fits=False when the model does not fit."""
    budget = space.max_num_batched_tokens
    kv_seqs = kv_capacity_seqs(dep, workload, space)
    if kv_seqs < 1:
        return [_row(dep, workload, 0, None, 0, False, "does not fit in memory", budget)]
    replica = ReplicaModel(dep, workload.input_len, workload.output_len, kv_seqs, space.max_num_batched_tokens,
                           workload.arrival_cv2)
    tail = space.slo_at_p99
    if workload.concurrency is not None:  # one replica under the benchmark's clients
        pred = replica.predict_closed_loop(workload.concurrency)
        return [_row(dep, workload, 1, pred, kv_seqs, pred.meets(slo, tail), pred.decode_bottleneck, budget)]
    capacity = replica.capacity_qps(slo, tail=tail)
    meets, target = capacity > 0, slo
    if not meets:  # report what merely keeping up would take
        capacity, target = replica.capacity_qps(None), None
        if capacity == 0:
            return [_row(dep, workload, 0, None, kv_seqs, False, "cannot keep up at any load", budget)]
    replicas = _fewest_replicas(replica, workload.qps, target, capacity, tail)
    pred = replica.predict(workload.qps / replicas)
    note = pred.decode_bottleneck if meets else "misses the SLO at any load"
    if space.max_total_gpus is not None and replicas * dep.world_size > space.max_total_gpus:
        note = f"over the budget of {space.max_total_gpus} GPUs"
    rows = [_row(dep, workload, replicas, pred, kv_seqs, meets and pred.meets(slo, tail), note, budget)]
    if rows[0].feasible:
        for more in sorted({replicas + 1, math.ceil(1.5 * replicas), 2 * replicas, 4 * replicas} - {replicas}):
            if space.max_total_gpus is None or more * dep.world_size <= space.max_total_gpus:
                extra = replica.predict(workload.qps / more)
                rows.append(_row(dep, workload, more, extra, kv_seqs, extra.meets(slo, tail), extra.decode_bottleneck,
                                 budget))
    return rows


def pareto_front(points: list[PlanRow]) -> list[PlanRow]:
    """Feasible points not beaten on both cost per million tokens and mean E2E latency."""
    front: list[PlanRow] = []
    for row in sorted((p for p in points if p.feasible), key=lambda p: (p.cost_per_million_tokens, p.e2e_ms)):
        if not front or row.e2e_ms < front[-1].e2e_ms:
            front.append(row)
    return front


def _rank_key(rank_by: str):
    def key(row: PlanRow):
        if rank_by == "gpus":
            return (not row.feasible, row.total_gpus if row.fits else math.inf, row.cost_per_million_tokens, row.e2e_ms)
        return (not row.feasible, row.cost_per_million_tokens, row.total_gpus, row.e2e_ms)
    return key


def check_context_fits(model: ModelConfig, workload: Workload) -> None:
    """ConfigError when a request (prompt + output) is longer than the model's context window."""
    seq_len = workload.input_len + workload.output_len
    if seq_len > model.max_position_embeddings:
        raise ConfigError(f"isl + osl = {seq_len} tokens exceeds the model's context window of "
                          f"{model.max_position_embeddings}")


def search(model: ModelConfig, devices: list[tuple[Hardware, Efficiency]], workload: Workload, slo: SLO,
           dtype: str = "bfloat16", space: SearchSpace = SearchSpace(), rank_by: str = "cost") -> Plan:
    """Plan `model` for `workload` under `slo` on each (device, efficiency) in `devices`."""
    if rank_by not in RANK_BY:
        raise ConfigError(f"--rank-by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    dtype_bytes_of(dtype)
    check_context_fits(model, workload)
    ranked, points, skipped = [], [], []
    for hw, efficiency in devices:
        if dtype not in hw.peak_flop_s:  # plan the devices that have it; none at all is an error
            skipped.append(f"{hw.name} (no {dtype} path)")
            continue
        for par in candidate_layouts(model, hw, space.max_nodes_per_replica):
            try:
                rows = plan_layout(Deployment(model, par, hw, dtype, efficiency), workload, slo, space)
            except ConfigError:  # e.g. a measured host without the links this layout needs
                continue
            ranked.append(rows[0])
            points.extend(rows)
    if len(skipped) == len(devices):
        devices[0][0].peak_flop_s_for(dtype)  # raises, naming what the device has
    ranked.sort(key=_rank_key(rank_by))
    return Plan(rows=tuple(ranked), points=tuple(p for p in points if p.feasible), pareto=tuple(pareto_front(points)),
                skipped=tuple(skipped))
