"""How many parameters each part of a decoder layer holds, whole (tp_size=1) or as one
tensor-parallel rank's slice under the engine's layout (ParallelConfig, docs/parallelism.md). The
one home of these counts: ModelConfig's totals (num_params, active_params_per_layer), the
planner's per-rank weights (planner/rank_shards.py) and its FLOPs (planner/cost_model.py) call
them. The KV cache's entries per token live here too: the same heads shape them. Pure arithmetic
on a ModelConfig: no torch, no engine code.

    attention         q: hidden x heads x head_dim, o: heads x head_dim x hidden, split by heads;
                      k, v: hidden x kv_heads x head_dim each, split by kv heads (one replicated
                      head per rank when tp > kv heads)
    latent attention  (MLA, DeepSeek) q: hidden x q_lora, then q_lora x heads x head_dim; kv:
                      hidden x (kv_lora + rope), then kv_lora x heads x (nope + v_head_dim); o:
                      heads x v_head_dim x hidden. The two down-projections (and their norms) are
                      replicated, the per-head ones split by heads; the cache holds the latent
                      (kv_lora + rope per token and layer) whole on every tp rank
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
    shaped by the same heads); MLA's latent, whole on every rank."""
    if model.mla is not None:
        return model.mla.latent_width
    return 2 * kv_heads_per_rank(model, tp_size) * model.head_dim


def qkv_params(model: ModelConfig, tp_size: int = 1) -> int:
    h, d, heads = model.hidden_size, model.head_dim, model.num_heads
    if model.mla is not None:
        m = model.mla
        q = h * m.q_lora_rank + m.q_lora_rank * heads * d // tp_size if m.q_lora_rank else h * heads * d // tp_size
        kv = h * m.latent_width + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) // tp_size
        return q + kv
    return h * d * heads // tp_size + 2 * h * d * kv_heads_per_rank(model, tp_size)


def o_params(model: ModelConfig, tp_size: int = 1) -> int:
    value_dim = model.mla.v_head_dim if model.mla is not None else model.head_dim
    return model.num_heads * value_dim * model.hidden_size // tp_size


def attention_params(model: ModelConfig, tp_size: int = 1) -> int:
    """The q, k, v and o projections of one layer (no biases)."""
    return qkv_params(model, tp_size) + o_params(model, tp_size)


def layer_norm_params(model: ModelConfig) -> int:
    latent_norms = model.mla.q_lora_rank + model.mla.kv_lora_rank if model.mla is not None else 0
    return 2 * model.hidden_size + (2 * model.head_dim if model.qk_norm else 0) + latent_norms


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
    # Qwen2-MoE gates its shared expert; DeepSeek's and Llama 4's are always fully on
    return model.hidden_size if model.shared_expert_intermediate_size and model.architecture == "qwen2_moe" else 0
