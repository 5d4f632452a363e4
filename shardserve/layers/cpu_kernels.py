"""Native CPU kernels, compiled on first use with torch's own extension builder (cached under
~/.cache/torch_extensions); everything falls back to plain torch ops when no compiler is there."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


@functools.lru_cache(maxsize=1)
def load_paged_decode_attention():
    """The compiled `paged_decode_attention` function, or None (disabled or no toolchain).
    Set SHARDSERVE_NATIVE_KERNELS=0 to use the torch fallback."""
    if os.environ.get("SHARDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name="shardserve_paged_decode_attention", sources=[str(_SOURCE)],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"], verbose=False)
        return module.paged_decode_attention
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("native CPU attention kernel unavailable, using torch ops: %s", exc)
        return None
