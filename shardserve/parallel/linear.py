"""Tensor-parallel linears (Megatron layout): each rank holds a slice of every weight and reads
only that slice from the checkpoint.

    x [T, hidden] --QKVParallelLinear--> [T, (H + 2 KV) / tp * D]   (this rank's heads; no comm)
        attention on local heads -> [T, H / tp * D]
      --RowParallelLinear (o_proj)--> partial [T, hidden] --all_reduce--> [T, hidden]
    x --MergedColumnParallelLinear (gate|up)--> [T, 2 I / tp] -> silu*mul -> [T, I / tp]
      --RowParallelLinear (down_proj)--> partial [T, hidden] --all_reduce--> [T, hidden]

Two all-reduces per layer; with tp == 1 every class is a plain Linear and nothing communicates.
"""
from __future__ import annotations

import torch

from shardserve.layers.linear import Linear
from shardserve.parallel.comm import all_reduce
from shardserve.parallel.groups import GroupInfo


def split(size: int, tp: GroupInfo, what: str) -> int:
    if size % tp.size:
        raise ValueError(f"{what} of {size} does not split over tp={tp.size}")
    return size // tp.size


class MergedColumnParallelLinear(Linear):
    """Several column-parallel outputs fused (gate|up): rank r holds rows [r n/tp, (r+1) n/tp) of
    each; the output stays split across ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype, tp: GroupInfo):
        local = [split(n, tp, "output size") for n in output_sizes]
        super().__init__(input_size, local, bias, dtype, row_starts=[tp.rank * n for n in local])


class QKVParallelLinear(Linear):
    """q, k, v projections fused; rank r gets query heads [r H/tp, (r+1) H/tp) and the KV heads
    they attend to: KV/tp of them, or with tp > KV one head shared by tp/KV ranks.

        tp=4, KV=2:  ranks 0 1 -> kv head 0,  ranks 2 3 -> kv head 1   (first head r * KV // tp)
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, dtype: torch.dtype, tp: GroupInfo):
        self.num_local_heads = split(num_heads, tp, "num_heads")
        self.num_local_kv_heads = max(1, num_kv_heads // tp.size)
        q_size, kv_size = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        kv_start = tp.rank * num_kv_heads // tp.size * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, dtype,
                         row_starts=[tp.rank * q_size, kv_start, kv_start])


class RowParallelLinear(Linear):
    """Input features split: rank r holds columns [r n/tp, (r+1) n/tp) and gets a partial sum,
    all-reduced over the tp group; the bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, tp: GroupInfo):
        local = split(input_size, tp, "input size")
        super().__init__(local, [output_size], bias, dtype, input_slice=(tp.rank * local, local))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        out = all_reduce(self.matmul(x, None), self.tp)  # [T, out]: partial sums, then the total
        return out if self.bias is None else out + self.bias
