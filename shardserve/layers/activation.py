"""SwiGLU activation on a fused gate/up projection (on CPU one native op, on a GPU one Triton
kernel, else two torch ops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.layers.cpu_kernels import load_silu_mul
from shardserve.layers.gpu_kernels import triton_available


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * d] laid out as [gate | up] -> [num_tokens, d]."""
    native = load_silu_mul() if gate_up.device.type == "cpu" and gate_up.is_contiguous() else None
    if native is not None:
        return native(gate_up)
    if gate_up.device.type == "cuda" and gate_up.is_contiguous() and triton_available():
        from shardserve.layers.gpu_kernels.elementwise import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
