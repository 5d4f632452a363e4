"""RMSNorm with the residual add folded in, computed in float32 whatever the activation dtype
(as the reference models do). On CPU one native op does both, on a GPU one Triton kernel;
elsewhere plain torch ops."""
from __future__ import annotations

import torch
from torch import nn

from shardserve.layers.cpu_kernels import load_add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.fused = load_add_rms_norm() if self.weight.device.type == "cpu" else _gpu_kernel(self.weight.device)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden], the residual stream. With `delta`, first `x += delta` in place
        (the residual add of the previous sub-layer); returns the normalized stream."""
        if self.fused is not None and x.is_contiguous():
            return self.fused(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _gpu_kernel(device: torch.device):
    from shardserve.layers.gpu_kernels import triton_available

    if device.type != "cuda" or not triton_available():
        return None
    from shardserve.layers.gpu_kernels.elementwise import add_rms_norm

    return add_rms_norm
