"""The one interface every attention backend implements, and the choice of backend per device.

    runner, once per step:   meta = backend.build_metadata(spans, num_decodes, cache)
    each attention layer:    out  = backend.forward(qkv, cos_sin, kv_cache, meta, num_heads, scale)

`forward` takes the layer's fused projection `qkv [T, H + 2 KV, D]` (queries, keys, values as
adjacent heads, keys not yet rotated), rotates queries and keys, stores this step's keys and
values in the layer's cache `[2, KV, num_blocks, block_size, D]` and returns the attention
output `[T, H, D]`. Metadata is the backend's own type: only the backend that built it reads it.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from shardserve.layers.attention.paged_kv import PagedCache, SeqSpan


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, spans: list[SeqSpan], num_decodes: int, cache: PagedCache) -> Any:
        """Per-step tensors shared by every layer; `spans[:num_decodes]` are the decodes."""

    def forward(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: Any, num_heads: int, scale: float) -> torch.Tensor:
        """[T, H + 2 KV, D] -> [T, H, D]; this step's keys and values are stored on the way."""


def attention_backend(device: torch.device, name: str | None = None, deterministic: bool = True) -> AttentionBackend:
    """The backend `name`, or the fastest one for `device`: the native CPU kernels on a CPU
    where they built, the Triton kernels on a GPU where Triton is installed, the torch reference
    path elsewhere. `deterministic`: EngineConfig.deterministic (the CPU kernels' choice)."""
    from shardserve.layers.attention.cpu_backend import CpuNativeAttention
    from shardserve.layers.attention.torch_backend import TorchAttention
    from shardserve.layers.attention.triton_backend import TritonAttention

    backends = {"torch": TorchAttention, "cpu_native": CpuNativeAttention, "triton": TritonAttention}
    if name is None:
        if device.type == "cpu":
            name = "cpu_native" if CpuNativeAttention.available() else "torch"
        else:
            name = "triton" if device.type == "cuda" and TritonAttention.available() else "torch"
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(backends)}")
    return CpuNativeAttention(deterministic) if name == "cpu_native" else backends[name]()
