"""The process heap under a CPU engine (glibc's malloc; elsewhere these do nothing).

glibc serves an allocation from its heap unless it is at least the mmap threshold, and it raises
that threshold to the size of every mmapped block freed, up to 32 MiB. Loading frees many large
blocks (checkpoint reads, weights before repacking), so afterwards every step's activations and
logits come from the heap, where a freed block in the middle stays resident: a Q4_1 SmolLM2
server grew 62 MiB over a 32-stream run, all of it freed memory. A fixed threshold keeps large
blocks mmapped, so they go back to the system when freed.
"""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# mmapping costs a system call and a page fault per 4 KiB on every use: offline, 64 prompts of
# SmolLM2 Q8_0 at once ran 418 output tok/s at 1 MiB, 402 at 4 MiB, 375 at 32 MiB (what glibc
# climbs to) and 325 at 128 KiB (its start), alternating processes; at 1 MiB a 32-stream server
# still grows its heap 23-50 MiB (128 KiB: 8), the price of the faster steps
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def fix_mmap_threshold(num_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep blocks of at least `num_bytes` out of the heap from now on; False where not glibc."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, num_bytes))


def return_freed_heap() -> None:
    """Hand freed heap memory back to the system now (the loader's, before the KV pool is
    committed on top of it: about 20 MiB for SmolLM2, which a prefaulted pool's peak carries)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
