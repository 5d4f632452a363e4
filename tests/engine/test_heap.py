"""engine/heap.py's two policies, each against a control in a fresh process: loading leaves no
freed block resident in the heap; serving reuses the pages of a freed activation-sized block."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")

LOADING_PROBE = """
import pathlib, sys, torch
from shardserve.engine.heap import heap_for_loading
def rss_mib():
    line = next(l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS'))
    return int(line.split()[1]) / 1024
big = torch.ones(24 << 20, dtype=torch.uint8)  # freed: glibc now serves blocks below 24 MiB from the heap
del big
if sys.argv[1] == 'policy':
    heap_for_loading()
blocks = []
for _ in range(64):  # 16 MiB of transient blocks, each under a long-lived small one
    blocks.append(torch.ones(256 << 10, dtype=torch.uint8))
    blocks.append(torch.ones(1000))
before = rss_mib()
del blocks[::2]
print(before - rss_mib())
"""

SERVING_PROBE = """
import ctypes, resource, sys
from shardserve.engine.heap import heap_for_loading, heap_for_serving
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
(heap_for_serving if sys.argv[1] == 'policy' else heap_for_loading)()
size = 6 << 20  # a decode step's logits: 32 rows x 49,152 floats
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)  # the next step's
ctypes.memset(block, 1, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def probe(code: str, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", code, mode], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def test_loading_returns_freed_blocks_to_the_system():
    assert probe(LOADING_PROBE, "policy") >= 12  # the 16 MiB of transients, unmapped
    assert probe(LOADING_PROBE, "control") < 4  # glibc's own policy keeps them as holes in the heap


def test_serving_reuses_a_freed_blocks_pages():
    assert probe(SERVING_PROBE, "policy") < 100  # the 6 MiB come back from the heap, already mapped
    assert probe(SERVING_PROBE, "control") > 1000  # mmapped afresh: a fault per 4 KiB page (1,536)
