"""layers/huge_pages.py: weights moved into one 2 MiB-aligned region the kernel may back with huge
pages, values unchanged, each on a cache line; and the engine's streamed weights are there."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardserve.layers.huge_pages import ALIGN, HUGE_PAGE, move_to_huge_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and transparent huge pages")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may be backed by huge pages (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return False


def test_weights_move_back_to_back_into_one_aligned_region_unchanged():
    weights = [SimpleNamespace(data=torch.randint(0, 255, (37, 100), dtype=torch.uint8)),
               SimpleNamespace(data=torch.randn(3, 5, 7).to(torch.bfloat16)),
               SimpleNamespace(data=torch.randn(1000))]
    before = [w.data.clone() for w in weights]
    assert move_to_huge_pages(weights)
    pointers = [w.data.data_ptr() for w in weights]
    assert pointers[0] % HUGE_PAGE == 0
    assert pointers[1] == pointers[0] + 3712 and pointers[2] == pointers[1] + 256  # 3700 and 210 bytes, rounded up to 64
    assert all(p % ALIGN == 0 for p in pointers)
    for w, b in zip(weights, before):
        assert w.data.is_contiguous() and w.data.dtype == b.dtype and torch.equal(w.data, b)
    if THP.exists() and "[never]" not in THP.read_text():
        assert thp_eligible(pointers[0])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages off")
def test_the_engines_streamed_weights_may_be_in_huge_pages():
    from shardserve.llm import LLM

    llm = LLM("smollm2", dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False)
    model = llm.engine.executor.runner.model
    weights = (model.lm_head.packed, model.layers[0].mlp.down_proj.packed, model.layers[-1].self_attn.qkv_proj.packed)
    assert all(thp_eligible(w.data.data_ptr()) for w in weights)
