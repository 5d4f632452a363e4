"""The KV pool's memory: committed on first write, or all at once when prefaulted."""
import pytest
import torch

from shardserve.engine.kv_cache import KVCache
from shardserve.layers.attention.paged_kv import KVShape


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("prefault", [False, True])
def test_pool_is_committed_on_first_write_unless_prefaulted(prefault):
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=64)
    pool_bytes = shape.block_bytes(16, torch.bfloat16) * 1024  # 32 MiB
    before = resident_bytes()
    cache = KVCache.allocate(shape, 1024, 16, torch.bfloat16, torch.device("cpu"), prefault=prefault)
    grown = resident_bytes() - before
    assert grown >= 0.9 * pool_bytes if prefault else grown < 0.1 * pool_bytes
    assert all(layer.abs().sum() == 0 for layer in cache.layers)  # zero-filled either way
    cache.layers[0][0, 0, 5] = 1.0  # writable, and layers do not alias
    assert cache.layers[1].abs().sum() == 0
