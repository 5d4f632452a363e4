"""Native CPU kernels, compiled on first use with torch's own extension builder (cached under
~/.cache/torch_extensions); everything falls back to plain torch ops when no compiler is there."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"


# every extension in csrc/
EXTENSIONS = ("panel_linear", "fused_elementwise", "paged_decode_attention", "paged_prefill_attention", "argmax_rows",
              "block_linear", "decode_stack")


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the compiler's target is all there is to go by
        import platform

        return f"model name: {platform.processor()} {platform.machine()}"


def cpu_identity(cpuinfo: str) -> str:
    """A short hash of what `-march=native` compiles for: the CPU's vendor, family, model and
    feature flags (the first processor's; lines that change from read to read, like its clock,
    are left out)."""
    wanted = ("model name", "flags", "vendor_id", "cpu family", "model")
    lines = []
    for line in cpuinfo.splitlines():
        if not line.strip():
            if lines:
                break  # the first processor is enough: the cores of one host are alike
            continue
        key = line.split(":", 1)[0].strip()
        if key in wanted:
            lines.append(line.strip())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


@functools.cache
def _rebuild_keys() -> list[str]:
    """Flags that only make torch rebuild an extension (it compares sources and flags): the
    headers' hash (their changes count too) and the CPU's identity (-march=native means another
    instruction set on another CPU but is the same flag, so a cache shared by two kinds of host
    would hand one the other's build: AMX code on a CPU without AMX dies of SIGILL). Read once
    for all the extensions."""
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))).hexdigest()[:16]
    return [f"-DSHARDSERVE_HEADERS={headers}", f"-DSHARDSERVE_CPU={cpu_identity(_read_cpuinfo())}"]


@functools.lru_cache(maxsize=None)
def _load(name: str):
    """The compiled extension `csrc/<name>.cpp`, or None (disabled or no toolchain).
    Set SHARDSERVE_NATIVE_KERNELS=0 to use the torch fallbacks."""
    if os.environ.get("SHARDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load

        # no fast math and no contracted multiply-adds: each kernel's rounding is the one its
        # code spells out (the exact ops round as torch's do; the attention kernels share theirs)
        flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
        flags += _rebuild_keys()
        # each kernel registers its functions as torch ops in the namespace shardserve_<name>
        load(name=f"shardserve_{name}", sources=[str(_CSRC / f"{name}.cpp")], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return getattr(torch.ops, f"shardserve_{name}")
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("native CPU kernel %s unavailable, using torch ops: %s", name, exc)
        return None


def build_all() -> None:
    """Build (or load from the cache) every native kernel now, as many at once as there are cores.
    Each compile takes 10-15 s of one core on a fresh machine (torch's headers dominate), and
    each build is a single compiler process: one after the other they left the other cores idle."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_load, EXTENSIONS))


def load_paged_decode_attention():
    """`paged_decode_attention(q, k_cache, v_cache, block_table, context_lens, scale)` or None."""
    module = _load("paged_decode_attention")
    return None if module is None else module.paged_decode_attention


def load_paged_prefill_attention(dtype, head_dim: int):
    """`paged_prefill_attention(q, k_cache, v_cache, block_table, query_starts, query_lens,
    context_lens, scale, out)` (writes the chunks' rows of `out`) for `dtype` and `head_dim`, or
    None: no toolchain, or a CPU or shape the kernel does not cover (it needs AVX-512, or AVX2
    with head_dim a multiple of 8)."""
    module = _load("paged_prefill_attention")
    return None if module is None or not module.supported(dtype, head_dim) else module.paged_prefill_attention


def load_add_rms_norm():
    """`add_rms_norm(residual, delta | None, weight, eps)` (residual += delta in place; returns the
    normalized rows) or None. Exact float semantics: no fast-math."""
    module = _load("fused_elementwise")
    return None if module is None else module.add_rms_norm


def load_rotary_kv():
    """`rotary_kv(qkv [T, H + 2 KV, D], cos [T, D], sin [T, D], k_cache, v_cache, slots [T], H)` ->
    (rotated queries [T, H, D], rotated keys [T, KV, D]), keys and values stored at `slots`; or None.
    Rounds as apply_rotary + write_kv do."""
    module = _load("fused_elementwise")
    return None if module is None else module.rotary_kv


def load_panel_linear(dtype):
    """The panel linear kernel module for `dtype` (`pack(weight)`, `linear(x, packed, bias,
    out_features)`), or None: no toolchain, or a CPU without the instructions for that dtype."""
    module = _load("panel_linear")
    return module if module is not None and module.supported(dtype) else None


def load_silu_mul():
    """`silu_mul(gate_up [..., 2d])` -> silu(gate) * up [..., d], rounded as the torch ops round
    (its exp and its reciprocal differ from torch's in the last float32 bit or two); or None."""
    module = _load("fused_elementwise")
    return None if module is None else module.silu_mul


def load_argmax_rows():
    """`argmax_rows(logits [N, V] float32 contiguous)` -> int64 [N], what torch.argmax(dim=-1)
    gives (first index of the maximum, NaN the largest); or None."""
    module = _load("argmax_rows")
    return None if module is None else module.argmax_rows


def argmax_rows(logits):
    """logits.argmax(dim=-1); for float32 CPU logits the native vectorized scan (torch's is
    scalar: over SmolLM2's 49,152 logits 0.44 ms of a batch-32 step, 55 us of a batch-1 one)."""
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        native = load_argmax_rows()
        if native is not None:
            return native(logits)
    return logits.argmax(dim=-1)


def load_block_linear():
    """The block kernels' module for a weight in GGUF blocks packed as layers/block_quant.py packs
    it (`block_linear(x [N, in], w, format, bias | None, out, float_out)` -> [N, out];
    `block_rows(w, format, ids, cols, dtype)` -> the rows dequantized), or None."""
    return _load("block_linear")


def load_decode_stack():
    """`decode_stack(x, tensors, ints, qkv_biases, kv_caches, cos, sin, slots, block_table,
    context_lens, num_heads, head_dim, scale, eps)` -> (x, delta): a decode step's layer stack
    through the kernels above, called from C++ (csrc/decode_stack.cpp says what the lists hold);
    or None. It calls the other extensions' ops, so it is None unless they all load."""
    needed = ("panel_linear", "fused_elementwise", "paged_decode_attention", "block_linear")
    if any(_load(name) is None for name in needed):
        return None
    module = _load("decode_stack")
    return None if module is None else module.decode_stack
