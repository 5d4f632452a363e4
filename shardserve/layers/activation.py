"""SwiGLU activation on a fused gate/up projection (on CPU one native op, else two torch ops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.layers.cpu_kernels import load_silu_mul


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * d] laid out as [gate | up] -> [num_tokens, d]."""
    native = load_silu_mul() if gate_up.device.type == "cpu" and gate_up.is_contiguous() else None
    if native is not None:
        return native(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
