"""Memory capacity of a replica: weights per rank, KV bytes per token, and how many tokens and
sequences fit. Per rank, on the rank that runs out first: every rank of a replica holds the same
number of KV blocks (the engine agrees on the smallest count at start-up)."""
from __future__ import annotations

import math

from shardserve.config import ModelConfig, ParallelConfig
from shardserve.param_counts import kv_values_per_token
from shardserve.planner.hardware import Hardware
from shardserve.planner.rank_shards import StagePlan, stage_params_per_rank, stage_plans


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int) -> int:
    """K and V of every layer: 2 * layers * kv_heads * head_dim * bytes (experts do not add KV)."""
    return model.kv_bytes_per_token(dtype_bytes)


def stage_kv_bytes_per_token(model: ModelConfig, tp: int, stage: StagePlan, dtype_bytes: int) -> int:
    """KV bytes one token takes on one rank of `stage`: its layers' K and V heads on that rank."""
    return stage.num_layers * kv_values_per_token(model, tp) * dtype_bytes


def kv_bytes_per_token_per_rank(model: ModelConfig, par: ParallelConfig, dtype_bytes: int) -> int:
    """KV bytes per token on the busiest rank: 2 * stage layers * kv_heads_per_rank * head_dim *
    bytes. Ranks beyond tp in an ep > tp stage repeat attention, so ep does not shrink it."""
    par.validate(model)
    return max(stage_kv_bytes_per_token(model, par.tp_size, s, dtype_bytes) for s in stage_plans(model, par))


def weight_bytes_per_rank(model: ModelConfig, par: ParallelConfig, dtype_bytes: float) -> int:
    """Weight bytes on the most loaded rank (see rank_shards for what each rank holds)."""
    par.validate(model)
    return math.ceil(max(stage_params_per_rank(model, par, s) for s in stage_plans(model, par)) * dtype_bytes)


def max_batch_tokens(model: ModelConfig, par: ParallelConfig, hw: Hardware, dtype_bytes: float,
                     mem_fraction: float = 0.9, kv_bytes: int | None = None) -> int:
    """KV-cache tokens a replica can hold: the least, over stages, of
    floor((memory * mem_fraction - stage weight bytes) / stage KV bytes per token), at least 0.
    `mem_fraction` leaves room for activations, the CUDA context and fragmentation; `kv_bytes`
    per KV element (default: the weights' `dtype_bytes`; fp4 weights keep an fp8 cache). Under
    dp_attention each attention group holds its own sequences' KV: the replica holds that many
    times more."""
    par.validate(model)
    kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes
    tokens = []
    for stage in stage_plans(model, par):
        free_bytes = hw.memory_bytes * mem_fraction - stage_params_per_rank(model, par, stage) * dtype_bytes
        tokens.append(max(0, int(free_bytes // stage_kv_bytes_per_token(model, par.tp_size, stage, kv_bytes))))
    return min(tokens) * par.attention_groups


def max_num_seqs_that_fit(num_kv_tokens: int, seq_len: int, block_size: int = 16) -> int:
    """Sequences of `seq_len` tokens (prompt + output) whose paged KV fits in `num_kv_tokens`:
    each takes ceil(seq_len / block_size) whole blocks."""
    blocks_per_seq = math.ceil(seq_len / block_size)
    return (num_kv_tokens // block_size) // blocks_per_seq
