"""Linear layers whose weights may be assembled from several checkpoint tensors.

Checkpoints store q/k/v and gate/up as separate matrices; we fuse them into one matmul each.
Every parameter carries a `weight_loader(param, tensor, shard_id)` that knows where a checkpoint
tensor goes, so the model's `load_weights` is a name mapping and nothing else.

On CPU, weights are repacked once, after loading, into oneDNN's blocked layout: a plain
`F.linear` re-lays the weight out on every call, which costs 1.5-3x at decode batch sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard_id=None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout, or None where that path does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)  # 32: decode batch hint
    except (RuntimeError, AttributeError):  # a torch build without the op
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b) where W's output rows are the concatenation of `output_sizes` shards."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_shard
        self.packed: torch.Tensor | None = None
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, tensor)
        start = sum(self.output_sizes[:shard_id])
        default_weight_loader(param.data.narrow(0, start, self.output_sizes[shard_id]), tensor)

    def prepack(self) -> None:
        """Switch to the packed weight (after loading); the plain copy is released."""
        self.packed = prepack_weight(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
