"""Sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE), used in place of the MLP.

    x [T, H] --gate--> router logits [T, E] --route--> top-k (weights, ids) [T, k]
      |                                                       |
      +------------------------------> experts(x, ids, weights) -> [T, H]
      +--> shared_expert(x) * sigmoid(shared_expert_gate(x))  -> [T, H]   (Qwen2-MoE only)
"""
from __future__ import annotations

import re

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.layers.experts import Experts, route
from shardserve.layers.linear import Linear
from shardserve.parallel.comm import all_reduce
from shardserve.parallel.expert import ExpertLoadCounter, ExpertParallel, initial_placement, rebalance
from shardserve.parallel.groups import ParallelGroups
from shardserve.parallel.linear import split

# Per-expert checkpoint tensors (Mixtral's w1/w3/w2 or Qwen's gate/up/down) and the stacked form
# transformers >= 5 holds in memory; both map onto our stacked `experts.gate_up` / `experts.down`.
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?$")
_EXPERT_PARTS = {  # checkpoint part -> (our parameter, shard within it)
    "w1": ("gate_up", 0), "gate_proj": ("gate_up", 0),
    "w3": ("gate_up", 1), "up_proj": ("gate_up", 1),
    "w2": ("down", None), "down_proj": ("down", None),
    "gate_up_proj": ("gate_up", None),
}


def expert_param_name(name: str) -> tuple[str, tuple[int | None, int | None]] | None:
    """Checkpoint name of an expert tensor -> (our parameter name, (expert_id, shard)) for
    `Experts.weight_loader`; None when `name` is not an expert tensor. expert_id None: a stacked
    tensor over all experts."""
    match = _PER_EXPERT.match(name)
    if match:
        prefix, expert_id, part = match.groups()
        param, shard = _EXPERT_PARTS[part]
        return f"{prefix}.{param}", (int(expert_id), shard)
    match = _STACKED.match(name)
    if match:
        prefix, part = match.groups()
        return f"{prefix}.{_EXPERT_PARTS[part][0]}", (None, None)
    return None


class SparseMoeBlock(nn.Module):
    """forward(x [T, H]) -> [T, H]. `shared_expert` is an MLP of the shared width whose output is
    gated per token by sigmoid(shared_expert_gate(x)), or None (Mixtral, Qwen3-MoE).

    Parallel layouts: with ep > 1 the routed experts are spread over the stage's ranks and tokens
    travel to them (shardserve/parallel/expert.py); otherwise with tp > 1 every rank holds a
    1/tp slice of every expert's intermediate features and the partial outputs are all-reduced.
    The router is replicated; the shared expert is a tensor-parallel MLP either way."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shared_expert: nn.Module | None = None,
                 groups: ParallelGroups | None = None):
        super().__init__()
        groups = groups or ParallelGroups.single()
        self.top_k, self.normalize = config.num_experts_per_token, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, [config.num_experts], False, dtype)  # the router
        self.tp, self.expert_parallel = groups.tp, None
        self.load = ExpertLoadCounter(torch.zeros(config.num_experts, dtype=torch.long))
        width = config.moe_intermediate_size
        if groups.ep.size > 1:
            placement = initial_placement(config.num_experts, groups.ep.size, groups.config.num_redundant_experts)
            self.expert_parallel = ExpertParallel(groups.ep, placement)
            self.experts = Experts(config.num_experts, config.hidden_size, width, dtype,
                                   local_expert_ids=self.expert_parallel.local_expert_ids())
        else:
            local = split(width, groups.tp, "expert intermediate size")
            self.experts = Experts(config.num_experts, config.hidden_size, width, dtype,
                                   intermediate_slice=(groups.tp.rank * local, local))
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = Linear(config.hidden_size, [1], False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is not None:
            out = self.expert_parallel.forward(x, self.gate, self.experts, self.top_k, self.normalize, self.load)
        else:
            topk_weights, topk_ids = route(self.gate(x), self.top_k, self.normalize)  # [T, k] each
            self.load.routed += torch.bincount(topk_ids.flatten(), minlength=self.load.routed.numel())
            self.load.processed += topk_ids.numel()
            out = all_reduce(self.experts(x, topk_ids, topk_weights), self.tp)  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, H]
        return out


def moe_blocks(model: nn.Module) -> dict[int, SparseMoeBlock]:
    """This rank's MoE blocks by global layer id."""
    return {layer_id: layer.mlp for layer_id, layer in zip(model.layer_ids, model.layers)
            if isinstance(layer.mlp, SparseMoeBlock)}


def expert_load(model: nn.Module) -> dict[int, tuple[list[int], int, bool]]:
    """Per MoE layer of this rank: (tokens routed to each expert from the tokens this rank
    routed, rows this rank's experts computed, whether the layer is expert-parallel), since the
    last rebalance."""
    return {layer_id: (block.load.routed.tolist(), block.load.processed, block.expert_parallel is not None)
            for layer_id, block in moe_blocks(model).items()}


def rebalance_experts(model: nn.Module) -> None:
    """Re-place every expert-parallel layer's experts from its observed load (a collective over
    each stage's ranks); with ep == 1 only the counters restart."""
    for block in moe_blocks(model).values():
        if block.expert_parallel is not None:
            rebalance(block.expert_parallel, block.experts, block.load)
        else:
            block.load.reset()
