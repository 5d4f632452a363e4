"""How many parameters each part of a decoder layer holds, whole (tp_size=1) or as one
tensor-parallel rank's slice under the engine's layout (ParallelConfig, docs/parallelism.md). The
one home of these counts: ModelConfig's totals (num_params, active_params_per_layer), the
planner's per-rank weights (planner/rank_shards.py) and its FLOPs (planner/cost_model.py) call
them. The KV cache's entries per token live here too: the same heads shape them. Pure arithmetic
on a ModelConfig: no torch, no engine code.

    attention         q: hidden x heads x head_dim, o: heads x head_dim x hidden, split by heads;
                      k, v: hidden x kv_heads x head_dim each, split by kv heads (one replicated
                      head per rank when tp > kv heads)
    norms             two RMSNorms per layer (and Qwen3's q/k norms over head_dim), replicated
    dense MLP         gate, up, down: 3 x hidden x intermediate, split by intermediate features
    MoE               router hidden x experts (replicated); a routed expert 3 x hidden x
                      moe_intermediate, counted whole (which experts, or which slices of them, a
                      rank holds depends on ep: planner/rank_shards.py); the shared expert
                      (Qwen2-MoE) 3 x hidden x its width over tp, plus its sigmoid gate, hidden x 1,
                      replicated
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this module
    from shardserve.config import ModelConfig


def kv_heads_per_rank(model: ModelConfig, tp_size: int = 1) -> int:
    # tp > kv heads: each rank keeps one (replicated) kv head
    return max(1, model.num_kv_heads // tp_size)


def kv_values_per_token(model: ModelConfig, tp_size: int = 1) -> int:
    """K and V entries one token adds to one layer's cache on a rank (cache, not parameters, but
    shaped by the same heads)."""
    return 2 * kv_heads_per_rank(model, tp_size) * model.head_dim


def qkv_params(model: ModelConfig, tp_size: int = 1) -> int:
    h, d = model.hidden_size, model.head_dim
    return h * d * model.num_heads // tp_size + 2 * h * d * kv_heads_per_rank(model, tp_size)


def o_params(model: ModelConfig, tp_size: int = 1) -> int:
    return model.num_heads * model.head_dim * model.hidden_size // tp_size


def attention_params(model: ModelConfig, tp_size: int = 1) -> int:
    """The q, k, v and o projections of one layer (no biases)."""
    return qkv_params(model, tp_size) + o_params(model, tp_size)


def layer_norm_params(model: ModelConfig) -> int:
    return 2 * model.hidden_size + (2 * model.head_dim if model.qk_norm else 0)


def dense_mlp_params(model: ModelConfig, tp_size: int = 1) -> int:
    return 3 * model.hidden_size * model.intermediate_size // tp_size


def router_params(model: ModelConfig) -> int:
    return model.hidden_size * model.num_experts


def expert_params(model: ModelConfig) -> int:
    """One routed expert (gate, up, down), whole."""
    return 3 * model.hidden_size * model.moe_intermediate_size


def shared_expert_params(model: ModelConfig, tp_size: int = 1) -> int:
    """The shared expert's three matrices (its tp slice); 0 without one. Its gate: shared_expert_gate_params."""
    return 3 * model.hidden_size * model.shared_expert_intermediate_size // tp_size


def shared_expert_gate_params(model: ModelConfig) -> int:
    return model.hidden_size if model.shared_expert_intermediate_size else 0
