"""engine/heap.py: with the threshold fixed, a freed large block leaves the process even when
the heap's top is pinned; without it (after a large free raised glibc's threshold) it stays."""
import subprocess
import sys

import pytest

PROBE = """
import pathlib, sys, torch
from shardserve.engine.heap import fix_mmap_threshold
def rss_mib():
    line = next(l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS'))
    return int(line.split()[1]) / 1024
big = torch.ones(24 << 20, dtype=torch.uint8)  # freed: glibc now serves blocks below 24 MiB from the heap
del big
if sys.argv[1] == 'fixed':
    fix_mmap_threshold()
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(8)]
pin = [torch.ones(1000) for _ in range(64)]  # small blocks above them: the heap's top cannot shrink
before = rss_mib()
del blocks
print(before - rss_mib())
"""


def released_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_freed_large_blocks_leave_the_process_once_the_threshold_is_fixed():
    assert released_mib("fixed") >= 30  # the 32 MiB of blocks, unmapped
    assert released_mib("dynamic") < 8  # the control: glibc's own policy keeps them
