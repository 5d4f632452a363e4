"""The routed experts of one MoE layer: stacked SwiGLU weights and the per-expert loop.

Single-rank math, no collectives. On a GPU the routed experts are two grouped Triton GEMMs
(layers/gpu_kernels/fused_moe.py); elsewhere a loop over the experts a step's tokens picked.
The layer holds `num_local_experts` slots; `local_slots` maps a
global expert id to its slot, and experts absent from the map contribute zero. Expert parallelism
gives each rank a different map (shardserve/parallel/expert.py); tensor parallelism gives each
rank the slice `intermediate_slice` = (start, length) of every expert's intermediate features,
and its output is a partial sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.activation import silu_and_mul
from shardserve.layers.gpu_kernels import triton_available
from shardserve.layers.linear import copy_checked
from shardserve.layers.lazy_tensor import as_lazy


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).
    Weights are the softmax probabilities (in float32 whatever the logits' dtype) of the k
    largest experts, rescaled to sum to 1 when `normalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)  # [T, k]
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class Experts(nn.Module):
    """`gate_up` [num_local_experts, 2 * I, H] holds each expert's [gate | up] rows; `down`
    [num_local_experts, H, I]. Both carry `weight_loader(param, tensor, (expert_id, shard))`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 local_expert_ids: list[int] | None = None, intermediate_slice: tuple[int, int] | None = None):
        super().__init__()
        local_expert_ids = list(range(num_experts)) if local_expert_ids is None else local_expert_ids
        self.num_experts, self.full_intermediate_size = num_experts, intermediate_size
        self.intermediate_slice = intermediate_slice or (0, intermediate_size)
        intermediate_size = self.intermediate_size = self.intermediate_slice[1]
        self.local_slots = {expert_id: slot for slot, expert_id in enumerate(local_expert_ids)}
        num_local = len(local_expert_ids)
        self.gate_up = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, dtype=dtype),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, dtype=dtype),
                                 requires_grad=False)
        self.gate_up.weight_loader = self._load
        self.down.weight_loader = self._load
        self._slot_table: tuple[dict, torch.Tensor] | None = None  # (local_slots it was built from, table)

    def _load(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: tuple[int | None, int | None]) -> None:
        """shard_id = (expert_id, shard). expert_id None: `tensor` stacks all global experts
        (transformers' fused in-memory layout); otherwise it is that one expert's matrix.
        shard 0/1 = the gate/up half of `gate_up`; None = the whole slot. Experts not held here are
        skipped."""
        expert_id, shard = shard_id
        tensor = as_lazy(tensor)
        if expert_id is None:
            if tensor.shape[0] != self.num_experts:
                raise ValueError(f"stacked tensor has {tensor.shape[0]} experts, expected {self.num_experts}")
            for global_id in self.local_slots:
                self._load(param, tensor.narrow(0, global_id, 1)[0], (global_id, shard))
            return
        slot = self.local_slots.get(expert_id)
        if slot is None:
            return
        start, size = self.intermediate_slice
        target = param.data[slot]
        if param is self.down:  # [H, I]: our columns
            copy_checked(target, as_lazy(tensor).narrow(1, start, size).to(target.dtype))
            return
        full = self.full_intermediate_size
        halves = [shard] if shard is not None else [0, 1]  # gate | up, each [I, H] in the checkpoint
        for half in halves:
            offset = 0 if shard is not None else half * full
            rows = as_lazy(tensor).narrow(0, offset + start, size)
            copy_checked(target.narrow(0, half * size, size), rows.to(target.dtype))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] global expert ids; topk_weights [T, k] float32 -> [T, H],
        sum over each token's local experts of weight * expert(x). Accumulates in float32."""
        num_tokens, top_k = topk_ids.shape
        if x.device.type == "cuda" and triton_available():
            from shardserve.layers.gpu_kernels.fused_moe import fused_experts

            slots = self.slot_table(x.device)[topk_ids.flatten()]
            return fused_experts(x, self.gate_up, self.down, slots, topk_weights.flatten(), top_k)
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
        # Group the T*k (token, choice) pairs by expert: pair p = token * k + choice.
        #   flat_ids: [e(0,0) e(0,1) e(1,0) ...] -- argsort --> pairs of expert 0 | expert 1 | ...
        flat_ids = topk_ids.flatten()  # [T*k]
        order = flat_ids.argsort(stable=True)  # [T*k] pair ids, grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        flat_weights = topk_weights.flatten()  # [T*k]
        start = 0
        for expert_id, count in enumerate(counts):
            pairs = order[start:start + count]  # [n]
            start += count
            slot = self.local_slots.get(expert_id)
            if count == 0 or slot is None:
                continue
            tokens = pairs // top_k  # [n]
            h = silu_and_mul(F.linear(x.index_select(0, tokens), self.gate_up[slot]))  # [n, I]
            h = F.linear(h, self.down[slot])  # [n, H]
            out.index_add_(0, tokens, h.float() * flat_weights.index_select(0, pairs)[:, None])
        return out.to(x.dtype)

    def slot_table(self, device: torch.device) -> torch.Tensor:
        """[num_experts] int64 on `device`: each global expert's local slot, -1 when not held here;
        rebuilt when the placement changes (parallel/expert.py replaces `local_slots`)."""
        if self._slot_table is None or self._slot_table[0] is not self.local_slots:
            table = torch.full((self.num_experts,), -1, dtype=torch.int64)
            for expert_id, slot in self.local_slots.items():
                table[expert_id] = slot
            self._slot_table = (self.local_slots, table.to(device))
        return self._slot_table[1]

    def run_slots(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [n, H] rows, slots [n] the local slot to apply to each row -> [n, H], unweighted
        (expert parallelism weights and sums the rows where they came from)."""
        out = torch.empty_like(x)  # [n, H]
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.gate_up.shape[0]).tolist()
        start = 0
        for slot, count in enumerate(counts):
            if count:
                rows = order[start:start + count]  # [c]
                h = silu_and_mul(F.linear(x.index_select(0, rows), self.gate_up[slot]))  # [c, I]
                out.index_copy_(0, rows, F.linear(h, self.down[slot]))
            start += count
        return out
