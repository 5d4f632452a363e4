"""The preallocated KV-cache pool and how many blocks a memory budget buys."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.config import CacheConfig, ModelConfig


@dataclass
class KVCache:
    """Per layer one tensor [2, num_kv_heads, num_blocks, block_size, head_dim] (K then V)."""

    layers: list[torch.Tensor]
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def allocate(cls, model_config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (2, model_config.num_kv_heads, num_blocks, block_size, model_config.head_dim)
        # On CPU the pool is left to the kernel's zero-filled pages (a fresh allocation this large is
        # always mmapped): memory is committed as blocks are first written, not all at start-up.
        # Masked padding must read finite values, which zero pages (and every later write) are.
        alloc = torch.empty if device.type == "cpu" else torch.zeros
        layers = [alloc(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]
        return cls(layers, num_blocks, block_size, dtype)


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * model_config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """The explicit budget, or a fraction of the memory free now (after the weights loaded)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        fraction = 0.85
    else:
        import psutil

        free_bytes = psutil.virtual_memory().available
        fraction = 0.1
    if cache.kv_cache_memory_fraction is not None:
        fraction = cache.kv_cache_memory_fraction
    return int(free_bytes * fraction)
