"""Analytic cost model of one engine step: per-op roofline with efficiency factors, plus collectives.

A `Deployment` is one replica: model, ParallelConfig (the engine's own layout, see rank_shards),
device, dtype and efficiency factors. Per rank of each pipeline stage, for one micro-batch:

    gemm      = roof(gemm_flops / (peak * eff.gemm),  weight_bytes_read / (mem_bw * eff.memory))
    attention = roof(prefill_attn_flops / (attn_peak * eff.attention)
                     + decode_attn_flops / (attn_peak * eff.decode_attention_factor),
                     kv_bytes_read / (mem_bw * eff.kv_memory_factor))
    activations = activation_traffic_bytes / (mem_bw * eff.memory)
    stage     = gemm + attention + activations + comm (collectives and the p2p send on, at link bw * eff.network)
    roof(compute, memory) = max(compute, memory) + (1 - eff.overlap) * min(compute, memory)

(attn_peak: the peak of the KV cache's dtype, Deployment.attention_dtype; overlap 1 is the
classic roofline; the prior, 0.62, is what published GPU GEMMs near the ridge show (Efficiency),
and a CPU, which hides only part of the weight streaming under the arithmetic, calibrates a
lower one. Decode attention, one query token per sequence, runs a different kernel than a
prefill chunk's, hence its own factor.)

and a step of m micro-batches through pp stages takes the classic pipeline time

    step = sum(stage) + (m - 1) * max(stage) + eff.overhead_s(sequences, new tokens)

(the first micro-batch crosses every stage, the others follow at the slowest stage's pace;
m = num_micro_batches, default pp, at most one per sequence; m = 1 without pipeline).
Communication per layer: tp all-reduce of [T, h] after attention and after a dense or ep = 1 MoE
MLP; with ep > 1 a dispatch and a combine all-to-all of the busiest rank's rows (T k / ep on
average, more on the busiest: expert_load.busiest_rank_rows, which also sets the routed-expert
compute of a rank) and an all-gather of [T, h] over the stage (plus the shared expert's
all-reduce). With dp_attention the g = ep / tp attention groups share the batch by whole
sequences and wait for each other at every MoE layer, so attention, KV reads, LM-head rows,
all-reduces and host work are the busiest group's (busiest_group_load: one prompt chunk is not
split over groups; a batch of many sequences gives each about 1/g) and the all-gather goes: each
group keeps its own tokens. The embedding
all-reduces over tp, the LM head all-gathers the logits, stages hand [T, h] on point-to-point.
A group that spans more devices than a node has uses the NIC.
Activation traffic (activation_traffic.py: the elementwise kernels and the GEMMs' activation
reads and writes, per token and routed row) adds to each stage at the weights' memory rate, times
eff.activation_traffic. Launches and sampling are left to the host overhead,
`step_overhead_s + seq_overhead_s * N + token_overhead_s * T` for a step of N sequences and T new
tokens (the whole step's, not per micro-batch: the host prepares and samples the step once).
Uncalibrated factors are guesses (see Efficiency).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardserve.config import ConfigError, ModelConfig, ParallelConfig
from shardserve.dtypes import dtype_bytes_of, kv_bytes_of
from shardserve.param_counts import (
    attention_params, dense_mlp_params, expert_params, o_params, qkv_params, router_params,
)
from shardserve.planner.activation_traffic import activation_elements
from shardserve.planner.batch_load import BatchLoad, BatchSummary, num_attended_pairs, step_loads
from shardserve.planner.collectives import all_gather_time_s, all_to_all_time_s, p2p_time_s, ring_allreduce_time_s
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.expert_load import busiest_rank_rows
from shardserve.planner.hardware import Hardware
from shardserve.planner.memory_fit import stage_kv_bytes_per_token
from shardserve.planner.rank_shards import (
    StagePlan, routed_expert_params_per_rank, shared_expert_params_per_rank, stage_plans,
)


@dataclass(frozen=True)
class Deployment:
    """One replica as the cost model sees it. Validates the layout on construction (the engine's
    ParallelConfig.validate) and derives the pipeline stages once."""

    model: ModelConfig
    parallel: ParallelConfig
    hardware: Hardware
    dtype: str = "bfloat16"
    efficiency: Efficiency = field(default_factory=Efficiency)
    kv_dtype: str | None = None  # the KV cache's dtype when it is not the one `dtype` keeps
    # bytes a weight parameter takes where the weights are kept in another format than `dtype`
    # (an engine serving GGUF blocks under bfloat16 activations: 0.56-1.06)
    weight_bytes_per_param: float | None = None
    stages: tuple[StagePlan, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.parallel.validate(self.model)
        dtype_bytes_of(self.dtype)
        if self.kv_dtype is not None:
            kv_bytes_of(self.kv_dtype)
        if self.weight_bytes_per_param is not None and not self.weight_bytes_per_param > 0:
            raise ConfigError(f"weight_bytes_per_param must be > 0, got {self.weight_bytes_per_param}")
        self.hardware.peak_flop_s_for(self.dtype)
        object.__setattr__(self, "stages", stage_plans(self.model, self.parallel))

    @property
    def dtype_bytes(self) -> float:
        return dtype_bytes_of(self.dtype)

    @property
    def weight_bytes(self) -> float:
        """Bytes of a weight parameter as the replica keeps it (what a step reads of it)."""
        return self.dtype_bytes if self.weight_bytes_per_param is None else self.weight_bytes_per_param

    @property
    def kv_bytes(self) -> int:
        """Bytes of a KV element: `kv_dtype`'s if given (an engine told to keep an fp16 cache
        under fp4 weights), else what serving in `dtype` keeps."""
        return kv_bytes_of(self.kv_dtype or self.dtype)

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element between layers, the unit of every collective: a
        weight dtype narrower than 16 bits (fp8, fp4) still runs and reduces its activations
        in bfloat16, as every engine does."""
        return max(self.dtype_bytes, 2)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def attention_dtype(self) -> str:
        """The dtype attention's matmuls run in: the KV cache's. An fp8 cache (fp8 weights, and
        fp4 weights, which keep one) is attended in fp8 where the device has the path; fp4
        matmul units do not run attention."""
        if self.kv_bytes == 1:
            return "float8" if "float8" in self.hardware.peak_flop_s else "bfloat16"
        if self.kv_dtype is not None:
            return self.kv_dtype
        return self.dtype


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one whole (unsharded) layer for a chunk of tokens."""

    qkv_flops: float
    o_flops: float
    mlp_flops: float  # dense MLP, or active routed experts + shared expert (and its gate)
    router_flops: float
    attention_flops: float

    @property
    def gemm_flops(self) -> float:
        return self.qkv_flops + self.o_flops + self.mlp_flops + self.router_flops

    @property
    def total_flops(self) -> float:
        return self.gemm_flops + self.attention_flops


def attention_flops_per_pair(model: ModelConfig, decode: bool = False) -> int:
    """FLOPs of one (query, key) pair in one layer over all heads: 2 per multiply-add of QK^T
    over the key width and of PV over the value width. Per-head K and V: 4 heads d. MLA prefill
    up-projects the latents to per-head keys and values: 2 heads (nope + rope + v). MLA decode
    absorbs the up-projections into the query and the output (as every MLA engine does), so a
    pair costs the latent: 2 heads ((kv_lora + rope) + kv_lora)."""
    heads, m = model.num_heads, model.mla
    if m is None:
        return 4 * heads * model.head_dim
    if decode:
        return 2 * heads * (m.latent_width + m.kv_lora_rank)
    return 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)


def layer_flops(model: ModelConfig, num_tokens: int, context_len: int, layer_id: int = 0) -> LayerFlops:
    """FLOPs (2 per multiply-add) of layer `layer_id` for `num_tokens` new tokens at `context_len`:

        qkv   = 2 T h d (heads + 2 kv_heads)        o = 2 T heads d h
        mlp   = 2 T 3 h I                            (dense layer)
              = 2 T (k 3 h I_e + 3 h I_s + h)        (MoE layer; shared expert and gate if any)
        router = 2 T h E                             (MoE layer)
        attn  = attention_flops_per_pair * num_attended_pairs(T, C) (QK^T and PV; 4 T C heads d
                for a decode with per-head K and V)
    """
    t = num_tokens
    qkv, o = 2 * t * qkv_params(model), 2 * t * o_params(model)
    attention = attention_flops_per_pair(model, decode=t == 1) * num_attended_pairs(num_tokens, context_len)
    if not model.is_moe_layer(layer_id):
        return LayerFlops(qkv, o, 2 * t * dense_mlp_params(model), 0, attention)
    active = model.num_experts_per_token * expert_params(model) + shared_expert_params_per_rank(model, 1)
    return LayerFlops(qkv, o, 2 * t * active, 2 * t * router_params(model), attention)


def fraction_of_experts_hit(model: ModelConfig, num_tokens: float) -> float:
    """Expected fraction of routed experts that at least one of `num_tokens` tokens picks, under
    uniform routing: 1 - (1 - k / E)^T. Only those experts' weights are read in a step."""
    if not model.is_moe:
        return 0.0
    return 1.0 - (1.0 - model.num_experts_per_token / model.num_experts) ** num_tokens


@dataclass(frozen=True)
class StepTime:
    """Seconds of one engine step (one batch through every pipeline stage) and why.

    gemm_s / attention_s are compute times, memory_s the weight + KV read time and the
    activation traffic, comm_s the collectives and pipeline sends, each weighted like the step
    (sum over stages + (m - 1) times the slowest stage's). total_s combines compute and memory
    per stage with `roof_s`, so it is not the sum of the fields. `bottleneck` is the largest of:
    compute (op classes whose compute time wins their roofline), memory (those whose memory time
    wins, and the activation traffic), network (comm_s), overhead."""

    gemm_s: float
    attention_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    total_s: float
    bottleneck: str
    calibrated: bool

    def summary(self) -> str:
        label = "calibrated" if self.calibrated else "uncalibrated"
        parts = ", ".join(f"{name} {getattr(self, name + '_s') * 1e3:.3f} ms"
                          for name in ("gemm", "attention", "memory", "comm", "overhead"))
        return f"step {self.total_s * 1e3:.3f} ms ({self.bottleneck}-bound, {label}): {parts}"


@dataclass(frozen=True)
class _StageParts:
    """One stage's times for one micro-batch, on one of its ranks."""

    gemm_s: float
    weight_s: float
    attention_s: float
    kv_s: float
    comm_s: float
    overlap: float = 1.0
    activation_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (roof_s(self.gemm_s, self.weight_s, self.overlap) + roof_s(self.attention_s, self.kv_s, self.overlap)
                + self.activation_s + self.comm_s)


def roof_s(compute_s: float, memory_s: float, overlap: float) -> float:
    """Time of work that needs `compute_s` at its compute rate and `memory_s` at its memory rate,
    when `overlap` of the shorter one hides under the longer (1: the roofline's max; 0: the sum)."""
    return max(compute_s, memory_s) + (1.0 - overlap) * min(compute_s, memory_s)


def _link(dep: Deployment, crosses_nodes: bool) -> tuple[float, float]:
    """(bandwidth after the network efficiency, per-step latency) of the intra- or inter-node link."""
    hw = dep.hardware
    if crosses_nodes:
        bw, lat = hw.inter_node_bandwidth_bytes_s, hw.inter_node_latency_s
    else:
        bw, lat = hw.intra_node_bandwidth_bytes_s, hw.intra_node_latency_s
    if bw <= 0:
        kind = "inter-node" if crosses_nodes else "intra-node"
        raise ConfigError(f"{hw.name} has no {kind} link for layout tp={dep.parallel.tp_size} "
                          f"pp={dep.parallel.pp_size} ep={dep.parallel.ep_size}")
    return bw * dep.efficiency.network, lat


def _group_link(dep: Deployment, group_size: int) -> tuple[float, float]:
    # groups are runs of consecutive ranks, and consecutive ranks share a node
    return _link(dep, group_size > dep.hardware.devices_per_node)


def _stage_comm_s(dep: Deployment, stage: StagePlan, index: int, load: BatchLoad, local: BatchLoad) -> float:
    """`load`: the whole step's; `local`: what the busiest attention group holds (= load without
    dp_attention)."""
    model, par = dep.model, dep.parallel
    tp, ep, h, b = par.tp_size, par.ep_size, model.hidden_size, dep.activation_bytes
    act_bytes = local.num_tokens * h * b
    tp_allreduce = ring_allreduce_time_s(act_bytes, tp, *_group_link(dep, tp)) if tp > 1 else 0.0
    # per layer: after attention; after a dense MLP; after an ep = 1 MoE MLP (and its shared expert)
    total = stage.num_layers * tp_allreduce + stage.num_dense_layers * tp_allreduce
    if stage.num_moe_layers:
        moe = tp_allreduce if model.shared_expert_intermediate_size else 0.0
        if ep == 1:
            moe += tp_allreduce
        else:
            link = _group_link(dep, par.stage_size)
            # the busiest rank's rows: an all-to-all ends when its largest receiver is done
            routed_bytes = busiest_rank_rows(model, ep, load.num_tokens) * h * b
            moe += 2 * all_to_all_time_s(routed_bytes, ep, *link)
            if par.attention_groups == 1:  # repeated attention needs every token back on every rank
                moe += all_gather_time_s(act_bytes, ep, *link)
        total += stage.num_moe_layers * moe
    if stage.is_first:  # vocab-parallel embedding: zero outside the shard, then all-reduce
        total += tp_allreduce
    if stage.is_last and tp > 1:  # the LM head's [N, V/tp] logits gathered to [N, V]
        total += all_gather_time_s(local.num_seqs * model.vocab_size * b, tp, *_group_link(dep, tp))
    if not stage.is_last:  # residual stream to the next stage's rank at the same position
        last_rank, next_rank = (index + 1) * par.stage_size - 1, (index + 1) * par.stage_size
        per_node = dep.hardware.devices_per_node
        total += p2p_time_s(act_bytes, *_link(dep, last_rank // per_node != next_rank // per_node))
    return total


@dataclass(frozen=True)
class _StageWork:
    """One stage's work for one micro-batch, on one of its ranks."""

    gemm_flops: float
    weight_bytes: float
    attention_flops: float
    kv_bytes: float
    decode_attention_flops: float  # the part of attention_flops from decode tokens
    activation_traffic_bytes: float = 0.0  # activation_traffic.py


def _stage_work(dep: Deployment, stage: StagePlan, load: BatchLoad, local: BatchLoad) -> _StageWork:
    """`load`: the whole step's (what the experts see); `local`: the busiest attention group's,
    what attention and dense MLPs see (= load without dp_attention)."""
    model, par = dep.model, dep.parallel
    tp, ep, h = par.tp_size, par.ep_size, model.hidden_size
    tokens = load.num_tokens
    routed_rows = busiest_rank_rows(model, ep, tokens) if stage.num_moe_layers else 0.0
    # Params every token multiplies by, and params read from memory, on this rank.
    token_params = stage.num_layers * attention_params(model, tp) + stage.num_dense_layers * dense_mlp_params(model, tp)
    gemm_flops, read_params = 2 * local.num_tokens * token_params, float(token_params)
    if stage.num_moe_layers:
        shared = shared_expert_params_per_rank(model, tp)
        # ep = 1: every rank routes all tokens through tp slices; ep > 1: each routes its 1/ep chunk
        # and runs whole experts on the rows sent to it, the busiest rank setting the pace
        row_params = expert_params(model) / (tp if ep == 1 else 1)
        router_tokens = tokens / ep
        router = router_params(model)
        per_layer_flops = 2 * (local.num_tokens * shared + router_tokens * router + routed_rows * row_params)
        resident = routed_expert_params_per_rank(model, par) * fraction_of_experts_hit(model, tokens)
        gemm_flops += stage.num_moe_layers * per_layer_flops
        read_params += stage.num_moe_layers * (shared + router + resident)
    if stage.is_last:  # LM head on one row per sequence
        head_params = math.ceil(model.vocab_size / tp) * h
        gemm_flops += 2 * local.num_seqs * head_params
        read_params += head_params
    prefill_pair_flops = stage.num_layers * attention_flops_per_pair(model) / tp
    decode_attention_flops = stage.num_layers * attention_flops_per_pair(model, decode=True) / tp * local.num_decode_pairs
    attention_flops = prefill_pair_flops * (local.num_pairs - local.num_decode_pairs) + decode_attention_flops
    kv_token_bytes = stage_kv_bytes_per_token(model, tp, stage, dep.kv_bytes)
    return _StageWork(gemm_flops, read_params * dep.weight_bytes, attention_flops,
                      local.num_context_tokens * kv_token_bytes, decode_attention_flops,
                      activation_elements(model, par, stage, local.num_tokens, routed_rows) * dep.activation_bytes)


def _stage_parts(dep: Deployment, stage: StagePlan, index: int, load: BatchLoad, local: BatchLoad) -> _StageParts:
    eff, work, hw = dep.efficiency, _stage_work(dep, stage, load, local), dep.hardware
    peak_flop_s, attention_peak_flop_s = hw.peak_flop_s_for(dep.dtype), hw.peak_flop_s_for(dep.attention_dtype)
    prefill_attention_flops = work.attention_flops - work.decode_attention_flops
    return _StageParts(
        gemm_s=work.gemm_flops / (peak_flop_s * eff.gemm),
        weight_s=work.weight_bytes / (hw.memory_bandwidth_bytes_s * eff.memory),
        attention_s=(prefill_attention_flops / (attention_peak_flop_s * eff.attention)
                     + work.decode_attention_flops / (attention_peak_flop_s * eff.decode_attention_factor)),
        kv_s=work.kv_bytes / (hw.memory_bandwidth_bytes_s * eff.kv_memory_factor),
        comm_s=_stage_comm_s(dep, stage, index, load, local), overlap=eff.overlap,
        activation_s=(work.activation_traffic_bytes * eff.activation_traffic
                      / (hw.memory_bandwidth_bytes_s * eff.memory)),
    )


@dataclass(frozen=True)
class StepWork:
    """What one step asks of one device: FLOPs and bytes read per op class, summed over the
    pipeline stages a rank of each runs (each stage's ranks work in parallel). Used for MFU / MBU
    (shardserve/profiler) and the roofline; the same counts `step_time` divides by the peaks."""

    gemm_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    activation_traffic_bytes: float

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        """What MBU counts, as everyone does: the weights and the KV cache read (the activation
        traffic, which a step also pays for, is apart)."""
        return self.weight_bytes + self.kv_bytes


def step_work(dep: Deployment, batch: Sequence[tuple[int, int]] | BatchSummary) -> StepWork:
    """FLOPs and bytes of one step of `batch` (as `step_time` takes it) on a device of each stage."""
    load, local = step_loads(batch, dep.parallel.attention_groups)
    works = [_stage_work(dep, stage, load, local) for stage in dep.stages]
    names = ("gemm_flops", "attention_flops", "weight_bytes", "kv_bytes", "activation_traffic_bytes")
    return StepWork(*(sum(getattr(w, name) for w in works) for name in names))


def _num_micro_batches(par: ParallelConfig, num_seqs: float) -> int:
    if par.pp_size == 1:
        return 1
    # the engine cuts a step's sequences into micro-batches: never more than there are sequences
    return max(1, min(par.num_micro_batches or par.pp_size, int(num_seqs)))


def step_time(dep: Deployment, batch: Sequence[tuple[int, int]] | BatchSummary) -> StepTime:
    """Time one step of `batch`: (num_new_tokens, context_len) per sequence, or a BatchSummary.
    See the module docstring for the rule."""
    load, local = step_loads(batch, dep.parallel.attention_groups)
    num_micro = _num_micro_batches(dep.parallel, load.num_seqs)
    micro, local_micro = load.split(num_micro), local.split(num_micro)
    parts = [_stage_parts(dep, stage, i, micro, local_micro) for i, stage in enumerate(dep.stages)]
    slowest = max(parts, key=lambda p: p.total_s)

    def weighted(name: str) -> float:
        return sum(getattr(p, name) for p in parts) + (num_micro - 1) * getattr(slowest, name)

    gemm_s, weight_s, attention_s, kv_s, activation_s, comm_s = (
        weighted(n) for n in ("gemm_s", "weight_s", "attention_s", "kv_s", "activation_s", "comm_s"))
    # each attention group is its own engine process with its own scheduler and sampler: the
    # host work of a step is the busiest group's sequences and tokens, the groups in parallel
    overhead_s = dep.efficiency.overhead_s(local.num_seqs, local.num_tokens)
    total_s = sum(p.total_s for p in parts) + (num_micro - 1) * slowest.total_s + overhead_s
    pairs = ((gemm_s, weight_s), (attention_s, kv_s))
    shares = {"compute": sum(c for c, m in pairs if c >= m),
              "memory": sum(m for c, m in pairs if m > c) + activation_s, "network": comm_s, "overhead": overhead_s}
    return StepTime(
        gemm_s=gemm_s, attention_s=attention_s, memory_s=weight_s + kv_s + activation_s, comm_s=comm_s,
        overhead_s=overhead_s,
        total_s=total_s, bottleneck=max(shares, key=shares.__getitem__), calibrated=dep.efficiency.calibrated,
    )


def prefill_time(dep: Deployment, prompt_len: int, num_seqs: int = 1) -> StepTime:
    """One step that prefills `num_seqs` whole prompts of `prompt_len` tokens (no cached prefix)."""
    return step_time(dep, [(prompt_len, prompt_len)] * num_seqs)


def decode_step_time(dep: Deployment, batch_size: float, context_len: float) -> StepTime:
    """One decode step of `batch_size` sequences, each attending to `context_len` tokens."""
    return step_time(dep, BatchSummary(num_decode_seqs=batch_size, decode_context_len=context_len))
