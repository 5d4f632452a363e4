"""The preallocated KV-cache pool and how many blocks a memory budget buys."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from shardserve.config import CacheConfig
from shardserve.layers.attention.paged_kv import KVShape


@dataclass
class KVCache:
    """Per layer one tensor [2, num_kv_heads, num_blocks, block_size, head_dim] (K then V)."""

    layers: list[torch.Tensor]
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].shape[1] if self.layers else 0

    @property
    def head_dim(self) -> int:
        return self.layers[0].shape[-1] if self.layers else 0

    @property
    def device(self) -> torch.device:
        return self.layers[0].device if self.layers else torch.device("cpu")

    @classmethod
    def allocate(cls, shape: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, prefault: bool = False) -> "KVCache":
        num_layers = shape.num_layers
        shape = (2, shape.num_kv_heads, num_blocks, block_size, shape.head_dim)
        if device.type != "cpu":
            layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        else:
            # An anonymous mapping is zero-filled by the kernel and committed page by page as
            # blocks are first written, so RSS grows with use rather than by the whole budget at
            # start-up; with `prefault` it is all committed now (_commit). Masked padding that
            # attention may read is then zeros or real keys and values, never garbage.
            numel = math.prod(shape)
            region = mmap.mmap(-1, numel * num_layers * torch.finfo(dtype).bits // 8,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if prefault:
                _commit(region)
            pool = torch.frombuffer(region, dtype=dtype)
            layers = [pool[i * numel : (i + 1) * numel].view(shape) for i in range(num_layers)]
        return cls(layers, num_blocks, block_size, dtype)


def _commit(region: mmap.mmap) -> None:
    """Commit the whole pool now, in huge pages where the kernel allows them: a decode step reads
    every sequence's blocks, scattered over the pool, and with 4 KiB pages most of them cost a
    TLB miss of their own (offline mixed workload, bf16: 3-5% faster). A lazily committed pool
    keeps small pages, or it would grow 2 MiB at a time."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no transparent huge pages here: 4 KiB pages
        pass
    try:
        region.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))  # Linux >= 5.14
    except OSError:
        torch.frombuffer(region, dtype=torch.uint8)[:: mmap.PAGESIZE].zero_()  # one write per page


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
