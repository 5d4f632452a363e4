"""What one rank of a replica holds, under the engine's layout (shardserve/config.py ParallelConfig,
docs/parallelism.md), counted in parameters (each part's count: shardserve/param_counts.py):

    stage = max(tp, ep) ranks; attention and dense MLPs are tensor-parallel over runs of tp ranks
    (repeated ep / tp times when ep > tp); KV heads split over tp, one replicated head per rank
    when tp > kv heads.
    MoE layer, ep = 1: every expert split by its intermediate features over tp (like a dense MLP).
    MoE layer, ep > 1: num_experts / ep whole experts per rank (+ redundant slots); router
    replicated; the shared expert (Qwen2-MoE) tensor-parallel over tp.
    pipeline: the engine's own cost-balanced split (ParallelConfig.model_stages); the first stage
    holds the embedding, the last the final norm and LM head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardserve.config import ModelConfig, ParallelConfig
from shardserve.param_counts import (
    attention_params, dense_mlp_params, expert_params, layer_norm_params, router_params, shared_expert_gate_params,
    shared_expert_params,
)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: how many dense and MoE layers it runs, and which ends it holds."""

    num_dense_layers: int
    num_moe_layers: int
    is_first: bool
    is_last: bool

    @property
    def num_layers(self) -> int:
        return self.num_dense_layers + self.num_moe_layers


def stage_plans(model: ModelConfig, par: ParallelConfig) -> tuple[StagePlan, ...]:
    """The stages as the engine builds them (ParallelConfig.model_stages)."""
    stages = par.model_stages(model)
    plans = []
    for index, layer_ids in enumerate(stages):
        num_moe = sum(model.is_moe_layer(i) for i in layer_ids)
        plans.append(StagePlan(len(layer_ids) - num_moe, num_moe, index == 0, index == len(stages) - 1))
    return tuple(plans)


def shared_expert_params_per_rank(model: ModelConfig, tp: int) -> int:
    """The shared expert's tp slice plus its (replicated) sigmoid gate; 0 without one."""
    return shared_expert_params(model, tp) + shared_expert_gate_params(model)


def routed_expert_params_per_rank(model: ModelConfig, par: ParallelConfig) -> int:
    """Routed-expert weights resident on one rank: all experts' tp slices (ep = 1), or
    num_experts / ep whole experts plus the redundant slots (ep > 1)."""
    if par.ep_size == 1:
        return model.num_experts * expert_params(model) // par.tp_size
    return (model.num_experts // par.ep_size + par.num_redundant_experts) * expert_params(model)


def moe_layer_params_per_rank(model: ModelConfig, par: ParallelConfig) -> int:
    """Router (replicated) + shared expert slice + resident routed experts."""
    return (router_params(model) + shared_expert_params_per_rank(model, par.tp_size)
            + routed_expert_params_per_rank(model, par))


def stage_params_per_rank(model: ModelConfig, par: ParallelConfig, stage: StagePlan) -> int:
    """Parameters on one rank of `stage`: its layers' slices, plus the vocab-parallel embedding
    (first stage) and the LM head and final norm (last stage), each ceil(vocab / tp) rows; a tied
    head shares the embedding's rows only when both sit on the same stage."""
    tp = par.tp_size
    per_layer = attention_params(model, tp) + layer_norm_params(model)
    params = stage.num_layers * per_layer + stage.num_dense_layers * dense_mlp_params(model, tp)
    if stage.num_moe_layers:
        params += stage.num_moe_layers * moe_layer_params_per_rank(model, par)
    vocab_matrix = math.ceil(model.vocab_size / tp) * model.hidden_size
    shares_one_matrix = model.tie_word_embeddings and stage.is_first and stage.is_last
    num_vocab_matrices = int(stage.is_first) + int(stage.is_last) - int(shares_one_matrix)
    return params + num_vocab_matrices * vocab_matrix + (model.hidden_size if stage.is_last else 0)
