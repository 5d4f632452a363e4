"""The process heap under a CPU engine: one policy while loading, another while serving (glibc's
malloc; elsewhere these do nothing).

Loading allocates and frees many blocks (checkpoint reads, weights before they are repacked into
their huge-page region) between the long-lived objects it creates, and each freed block the heap
served stays a hole there. Serving then fills those holes with activations, and every page it
touches stays resident: with loading at a 1 MiB mmap threshold the heap held 86 MiB of holes, and a
Q4_0 SmolLM2 server's heap grew 45-61 MiB over a 32-stream run. So loading mmaps every block of
64 KiB and up (each leaves the process when freed; the heap's free space after loading fell to
5-10 MiB), and serving takes blocks up to 32 MiB (glibc's most) from the heap and keeps what it
frees at the top (up to 64 MiB): a step's activations and logits reuse heap pages earlier steps
touched instead of being mmapped afresh, a page fault per 4 KiB each time. (torch asks for 64-byte
aligned blocks, which a freed block of the same size does not always fit, so the heap still grows
some.) That server's heap then grew 18-26 MiB and its peak RSS fell 25-35 MiB, at the same
throughput (2026-12-07).
"""
from __future__ import annotations

import ctypes

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

LOADING_MMAP_THRESHOLD = 64 << 10
SERVING_MMAP_THRESHOLD = 32 << 20
SERVING_TRIM_THRESHOLD = 64 << 20


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def heap_for_loading() -> None:
    """Blocks of 64 KiB and up bypass the heap from now on (nothing where not glibc)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)


def heap_for_serving() -> None:
    """Hand the loader's freed heap back to the system, then let steps reuse heap memory for blocks
    up to 32 MiB and keep up to 64 MiB freed at the heap's top (nothing where not glibc)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
        libc.mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
