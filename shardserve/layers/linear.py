"""Linear layers whose weights may be assembled from several checkpoint tensors.

Checkpoints store q/k/v and gate/up as separate matrices; we fuse them into one matmul each.
Every parameter carries a `weight_loader(param, tensor, shard_id)` that knows where a checkpoint
tensor goes, so the model's `load_weights` is a name mapping and nothing else.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard_id=None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


class Linear(nn.Module):
    """y = x W^T (+ b) where W's output rows are the concatenation of `output_sizes` shards."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, tensor)
        start = sum(self.output_sizes[:shard_id])
        default_weight_loader(param.data.narrow(0, start, self.output_sizes[shard_id]), tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
