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


def huge_page_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


def test_prefaulted_pool_sits_in_huge_pages_and_a_lazy_one_does_not():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[madvise]" not in mode:
        pytest.skip(f"transparent huge pages not in madvise mode here: {mode.strip()}")
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=64)
    caches = {prefault: KVCache.allocate(shape, 1024, 16, torch.bfloat16, torch.device("cpu"), prefault=prefault)
              for prefault in (False, True)}
    caches[False].layers[0].fill_(1.0)  # committed by writes: small pages
    huge = {prefault: huge_page_bytes(c.layers[0].data_ptr()) for prefault, c in caches.items()}
    assert huge[True] >= 16 << 20  # most of the 32 MiB pool (its ends need not be 2 MiB aligned)
    assert huge[False] == 0
