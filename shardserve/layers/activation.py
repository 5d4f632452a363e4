"""SwiGLU activation on a fused gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * d] laid out as [gate | up] -> [num_tokens, d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
