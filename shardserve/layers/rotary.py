"""Rotary position embedding (NeoX / HF "rotate_half" layout), with Llama 3 frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from shardserve.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `scaling.kind` prescribes."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position up to `max_positions`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling, dtype: torch.dtype):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        # Cast like the reference: angles in float32, cos/sin rounded to the activation dtype.
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for positions [T]; looked up once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, heads, D] (queries and keys may be stacked along heads) -> rotated, same shape."""
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
