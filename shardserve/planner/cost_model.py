"""Analytic cost model of one engine step: per-op roofline with efficiency factors, plus collectives.

Layout of a deployment (`Parallelism`): a replica is `pp` pipeline stages of `tp` ranks each.
Attention and dense MLPs are tensor-sharded over the tp ranks of a stage. MoE experts are split
into `ep` groups over those same ranks (ep divides tp): each rank holds num_experts / ep experts,
each expert tensor-sharded tp / ep ways (the "moe_tp x moe_ep = tp" layout; ep = tp is plain
expert parallelism). KV heads are split over tp, one replicated head per rank when tp > kv heads.

Time rule of `step_time` (latency of one batch through all stages, on one tp rank chain):

    gemm      = max(gemm_flops / (peak * eff.gemm),      weight_bytes_read / (mem_bw * eff.memory))
    attention = max(attn_flops / (peak * eff.attention), kv_bytes_read     / (mem_bw * eff.memory))
    total     = gemm + attention + comm (tp all-reduce, ep all-to-all, pp p2p; / eff.network) + overhead

Everything is per rank: FLOPs and bytes divided by the sharding. Activation traffic, norms, rotary
and sampling are left to the per-step overhead. Uncalibrated factors are guesses (see Efficiency).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.config import ConfigError
from shardserve.planner.collectives import all_to_all_time_s, p2p_time_s, ring_allreduce_time_s
from shardserve.planner.hardware import Hardware
from shardserve.planner.model_shape import ModelShape, Parallelism, validate_layout

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float8": 1, "float32": 4}


def dtype_bytes_of(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak per op class, and a fixed cost per engine step.

    Defaults are uncalibrated priors from the literature (docs: planner-anchors.md):
    gemm 0.7 ("up to 0.7 for inference", llm-analysis); attention 0.5 (FlashAttention-2 forward
    reaches ~50-70% of peak; decode attention is memory-bound anyway); memory 0.8 (aiconfigurator's
    empirical HBM scaling factor); network 0.7 (NCCL ring bus bandwidth vs link peak);
    step_overhead_s 2 ms (scheduling, input prep, sampling, launches per Python engine step)."""

    gemm: float = 0.7
    attention: float = 0.5
    memory: float = 0.8
    network: float = 0.7
    step_overhead_s: float = 2e-3
    calibrated: bool = False

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "memory", "network"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"Efficiency.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.step_overhead_s < 0:
            raise ConfigError("Efficiency.step_overhead_s must be >= 0")

    @property
    def label(self) -> str:
        return "calibrated" if self.calibrated else "uncalibrated"


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one whole (unsharded) layer for a chunk of tokens."""

    qkv_flops: float
    o_flops: float
    mlp_flops: float  # dense MLP, or active routed + shared experts
    router_flops: float
    attention_flops: float

    @property
    def gemm_flops(self) -> float:
        return self.qkv_flops + self.o_flops + self.mlp_flops + self.router_flops

    @property
    def total_flops(self) -> float:
        return self.gemm_flops + self.attention_flops


def num_attended_pairs(num_tokens: int, context_len: int) -> int:
    """(query, key) pairs of a causal chunk: `num_tokens` new tokens ending a context of
    `context_len` tokens (new ones included). Token i of the chunk sees context_len - num_tokens + i
    keys: pairs = T * (C - T) + T * (T + 1) / 2. Decode (T = 1) gives C; a whole prompt
    (T = C) gives T(T+1)/2, the causal half of the square."""
    if num_tokens < 0 or context_len < num_tokens:
        raise ConfigError(f"need 0 <= num_tokens ({num_tokens}) <= context_len ({context_len})")
    return num_tokens * (context_len - num_tokens) + num_tokens * (num_tokens + 1) // 2


def _layer_gemm_flops(shape: ModelShape, num_tokens: int) -> tuple[float, float, float, float]:
    t, h, d = num_tokens, shape.hidden_size, shape.head_dim
    qkv = 2 * t * h * d * (shape.num_heads + 2 * shape.num_kv_heads)
    o = 2 * t * shape.num_heads * d * h
    if not shape.is_moe:
        return qkv, o, 2 * t * 3 * h * shape.intermediate_size, 0
    experts_per_token = shape.num_experts_per_token + shape.num_shared_experts
    return qkv, o, 2 * t * experts_per_token * shape.expert_params, 2 * t * h * shape.num_experts


def layer_flops(shape: ModelShape, num_tokens: int, context_len: int) -> LayerFlops:
    """FLOPs (2 per multiply-add) of one layer for `num_tokens` new tokens at `context_len`:

        qkv   = 2 T h d (heads + 2 kv_heads)        o = 2 T heads d h
        mlp   = 2 T 3 h I                            (dense)
              = 2 T (k + shared) 3 h I_e             (MoE, plus router = 2 T h E)
        attn  = 4 heads d * num_attended_pairs(T, C) (QK^T and PV; = 4 T C heads d for decode)
    """
    qkv, o, mlp, router = _layer_gemm_flops(shape, num_tokens)
    attention = 4 * shape.num_heads * shape.head_dim * num_attended_pairs(num_tokens, context_len)
    return LayerFlops(qkv, o, mlp, router, attention)


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    # tp > kv heads: each rank keeps one (replicated) kv head.
    return max(1, shape.num_kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """K and V of every layer: 2 * layers * kv_heads * head_dim * bytes (MoE does not change it)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def kv_bytes_per_token_per_rank(shape: ModelShape, par: Parallelism, dtype_bytes: int) -> int:
    """KV bytes per token on the busiest rank: 2 * ceil(layers / pp) * kv_heads_per_rank * head_dim * bytes."""
    validate_layout(shape, par)
    layers = math.ceil(shape.num_layers / par.pp)
    return 2 * layers * kv_heads_per_rank(shape, par.tp) * shape.head_dim * dtype_bytes


def _layer_params_per_rank(shape: ModelShape, par: Parallelism) -> tuple[int, int]:
    """(params every token reads, routed-expert params) of one layer on one rank."""
    h, d = shape.hidden_size, shape.head_dim
    attn = 2 * h * d * shape.num_heads // par.tp + 2 * h * d * kv_heads_per_rank(shape, par.tp)
    norms = 2 * h  # replicated on every rank
    if not shape.is_moe:
        return attn + 3 * h * shape.intermediate_size // par.tp + norms, 0
    # num_experts / ep experts per rank, each sharded tp / ep ways; router replicated.
    routed = (shape.num_experts // par.ep) * shape.expert_params // (par.tp // par.ep)
    shared = shape.num_shared_experts * shape.expert_params // par.tp
    return attn + h * shape.num_experts + shared + norms, routed


def weight_bytes_per_rank(shape: ModelShape, par: Parallelism, dtype_bytes: int) -> int:
    """Weight bytes on the most loaded rank: ceil(layers / pp) layers' shards, plus the vocab
    matrices sharded by tp (pp = 1: embedding + head, one matrix when tied; pp > 1: the first stage
    holds the embedding and the last the head, one vocab matrix each) and the final norm."""
    validate_layout(shape, par)
    layers = math.ceil(shape.num_layers / par.pp)
    vocab_matrix = shape.vocab_size * shape.hidden_size // par.tp
    num_vocab_matrices = 2 if par.pp == 1 and not shape.tie_word_embeddings else 1
    params = layers * sum(_layer_params_per_rank(shape, par)) + num_vocab_matrices * vocab_matrix + shape.hidden_size
    return params * dtype_bytes


def max_batch_tokens(shape: ModelShape, par: Parallelism, hw: Hardware, dtype_bytes: int,
                     mem_fraction: float = 0.9) -> int:
    """KV-cache tokens that fit beside the weights on the busiest rank:
    floor((memory * mem_fraction - weight_bytes_per_rank) / kv_bytes_per_token_per_rank), at least 0."""
    free_bytes = hw.memory_bytes * mem_fraction - weight_bytes_per_rank(shape, par, dtype_bytes)
    return max(0, int(free_bytes // kv_bytes_per_token_per_rank(shape, par, dtype_bytes)))


@dataclass(frozen=True)
class BatchSummary:
    """A step's batch in aggregate: one prompt chunk of `num_prefill_tokens` ending a context of
    `prefill_context_len` tokens, plus `num_decode_seqs` decodes at `decode_context_len` each."""

    num_prefill_tokens: int = 0
    prefill_context_len: int = 0
    num_decode_seqs: int = 0
    decode_context_len: int = 0


@dataclass(frozen=True)
class _BatchLoad:
    num_tokens: int  # new tokens through the GEMMs
    num_pairs: int  # attended (query, key) pairs
    num_context_tokens: int  # KV entries read
    num_seqs: int  # rows that reach the LM head


def _batch_load(batch: Sequence[tuple[int, int]] | BatchSummary) -> _BatchLoad:
    if isinstance(batch, BatchSummary):
        b = batch
        prefill_seqs = 1 if b.num_prefill_tokens else 0
        prefill_pairs = num_attended_pairs(b.num_prefill_tokens, b.prefill_context_len) if prefill_seqs else 0
        return _BatchLoad(
            num_tokens=b.num_prefill_tokens + b.num_decode_seqs,
            num_pairs=prefill_pairs + b.num_decode_seqs * num_attended_pairs(1, b.decode_context_len),
            num_context_tokens=prefill_seqs * b.prefill_context_len + b.num_decode_seqs * b.decode_context_len,
            num_seqs=prefill_seqs + b.num_decode_seqs,
        )
    return _BatchLoad(
        num_tokens=sum(t for t, _ in batch),
        num_pairs=sum(num_attended_pairs(t, c) for t, c in batch),
        num_context_tokens=sum(c for _, c in batch),
        num_seqs=len(batch),
    )


@dataclass(frozen=True)
class StepTime:
    """Seconds of one engine step (one batch through every pipeline stage) and why.

    gemm_s / attention_s are compute times, memory_s the weight + KV read time; total_s is
    max(gemm_s, weight read) + max(attention_s, KV read) + comm_s + overhead_s, so it is not the
    sum of the fields. `bottleneck` is the largest of: compute (op classes whose compute time
    wins their roofline), memory (those whose memory time wins), network (comm_s), overhead."""

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


def fraction_of_experts_hit(shape: ModelShape, num_tokens: int) -> float:
    """Expected fraction of routed experts that at least one of `num_tokens` tokens picks, under
    uniform routing: 1 - (1 - k / E)^T. Only those experts' weights are read in a step."""
    if not shape.is_moe:
        return 0.0
    return 1.0 - (1.0 - shape.num_experts_per_token / shape.num_experts) ** num_tokens


def _comm_time_s(shape: ModelShape, par: Parallelism, hw: Hardware, dtype_bytes: int,
                 num_tokens: int, network_eff: float) -> float:
    """tp: 2 all-reduces of T*h activations per layer; with ep > 1 the MoE one becomes a dispatch
    and a combine all-to-all of T*k*h per ep share (+ an all-reduce over the tp/ep expert shards);
    pp: one p2p of T*h activations per stage boundary. A group larger than a node uses the NIC."""
    def link(group_size: int) -> tuple[float, float]:
        if group_size <= hw.devices_per_node:
            return hw.intra_node_bandwidth_bytes_s * network_eff, hw.intra_node_latency_s
        return hw.inter_node_bandwidth_bytes_s * network_eff, hw.inter_node_latency_s

    act_bytes = num_tokens * shape.hidden_size * dtype_bytes
    bw, lat = link(par.tp)
    if par.tp > 1 and bw <= 0:
        raise ConfigError(f"{hw.name} has no link for tp={par.tp}")
    per_layer = ring_allreduce_time_s(act_bytes, par.tp, bw, lat) if par.tp > 1 else 0.0
    if par.ep > 1:
        routed_bytes = act_bytes * shape.num_experts_per_token / par.ep
        per_layer += 2 * all_to_all_time_s(routed_bytes, par.ep, bw, lat)
        per_layer += ring_allreduce_time_s(routed_bytes, par.tp // par.ep, bw, lat)
    else:
        per_layer *= 2
    total = shape.num_layers * per_layer
    if par.pp > 1:
        bw, lat = link(par.world_size)
        if bw <= 0:
            raise ConfigError(f"{hw.name} has no link for pp={par.pp}")
        total += (par.pp - 1) * p2p_time_s(act_bytes, bw, lat)
    return total


def step_time(shape: ModelShape, par: Parallelism, hw: Hardware, dtype: str,
              batch: Sequence[tuple[int, int]] | BatchSummary, efficiency: Efficiency | None = None) -> StepTime:
    """Time one step of `batch`: (num_new_tokens, context_len) per sequence, or a BatchSummary.
    Weights and KV use `dtype`; see the module docstring for the rule."""
    validate_layout(shape, par)
    eff = efficiency or Efficiency()
    dtype_bytes, peak_flop_s = dtype_bytes_of(dtype), hw.peak_flop_s_for(dtype)
    load = _batch_load(batch)
    h, num_layers = shape.hidden_size, shape.num_layers
    qkv, o, mlp, router = _layer_gemm_flops(shape, load.num_tokens)
    head_flops = 2 * load.num_seqs * h * shape.vocab_size / par.tp
    gemm_flops = num_layers * ((qkv + o + mlp) / par.tp + router) + head_flops
    attn_flops = num_layers * 4 * shape.num_heads * shape.head_dim * load.num_pairs / par.tp
    # Bytes one rank chain reads: every layer's shard once (routed experts only when hit), the
    # head shard, and the K/V of every context token for this rank's kv heads.
    always, routed = _layer_params_per_rank(shape, par)
    layer_params = always + routed * fraction_of_experts_hit(shape, load.num_tokens)
    weight_read_bytes = (num_layers * layer_params + shape.vocab_size * h / par.tp) * dtype_bytes
    kv_token_bytes = 2 * num_layers * kv_heads_per_rank(shape, par.tp) * shape.head_dim * dtype_bytes
    kv_read_bytes = load.num_context_tokens * kv_token_bytes

    mem_bw = hw.memory_bandwidth_bytes_s * eff.memory
    gemm_s, weight_s = gemm_flops / (peak_flop_s * eff.gemm), weight_read_bytes / mem_bw
    attention_s, kv_s = attn_flops / (peak_flop_s * eff.attention), kv_read_bytes / mem_bw
    comm_s = _comm_time_s(shape, par, hw, dtype_bytes, load.num_tokens, eff.network)
    compute_part = sum(c for c, m in ((gemm_s, weight_s), (attention_s, kv_s)) if c >= m)
    memory_part = sum(m for c, m in ((gemm_s, weight_s), (attention_s, kv_s)) if m > c)
    parts = {"compute": compute_part, "memory": memory_part, "network": comm_s, "overhead": eff.step_overhead_s}
    return StepTime(
        gemm_s=gemm_s, attention_s=attention_s, memory_s=weight_s + kv_s, comm_s=comm_s,
        overhead_s=eff.step_overhead_s,
        total_s=max(gemm_s, weight_s) + max(attention_s, kv_s) + comm_s + eff.step_overhead_s,
        bottleneck=max(parts, key=parts.__getitem__), calibrated=eff.calibrated,
    )


def prefill_time(shape: ModelShape, par: Parallelism, hw: Hardware, dtype: str, prompt_len: int,
                 num_seqs: int = 1, efficiency: Efficiency | None = None) -> StepTime:
    """One step that prefills `num_seqs` whole prompts of `prompt_len` tokens (no cached prefix)."""
    return step_time(shape, par, hw, dtype, [(prompt_len, prompt_len)] * num_seqs, efficiency)


def decode_step_time(shape: ModelShape, par: Parallelism, hw: Hardware, dtype: str, batch_size: int,
                     context_len: int, efficiency: Efficiency | None = None) -> StepTime:
    """One decode step of `batch_size` sequences, each attending to `context_len` tokens."""
    summary = BatchSummary(num_decode_seqs=batch_size, decode_context_len=context_len)
    return step_time(shape, par, hw, dtype, summary, efficiency)
