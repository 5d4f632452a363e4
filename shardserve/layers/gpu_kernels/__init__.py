"""Triton kernels for the GPU path: one module per concept, each with a torch-facing wrapper.

Triton runs on NVIDIA and AMD GPUs alike, and its interpreter (`TRITON_INTERPRET=1`, set before
these modules are imported) runs the same kernels on a CPU, which is how the suite checks each
one against the torch reference path (tests/layers/test_gpu_kernels.py). Triton is imported
only here and only when a kernel is used: a CPU install without it never loads these modules.
"""
from __future__ import annotations

import functools
import os

def dot_f32(dtype) -> bool:
    """Whether a kernel should cast its tl.dot operands to float32: under Triton's interpreter,
    which (3.9) multiplies bfloat16 operands as raw bits, in elementwise ops and tl.dot alike.
    The kernels do their elementwise math in float32 anyway (as the reference does); a GPU gets
    the activation dtype's tensor-core dot. Both accumulate in float32. Read at each launch: the
    flag may be set after this module is imported, before the kernels' modules are."""
    import torch

    return os.environ.get("TRITON_INTERPRET") == "1" and dtype != torch.float32


def dot_precision(dtype) -> str:
    """tl.dot's input precision for activations of `dtype`: float32 ones multiply in full float32
    ("ieee"), not the TF32 a GPU would use by default (10 mantissa bits: ~1e-3 off a float32
    reference, where a float32 engine is asked to agree to 1e-5)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
