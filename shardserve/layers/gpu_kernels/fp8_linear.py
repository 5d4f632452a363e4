"""x W^T for fp8 weights at decode batch sizes (weight-only: the activations stay bfloat16).

With a handful of rows a linear layer is a matrix-vector product: its time is the weight's bytes
over the memory bandwidth, and fp8 halves them. torch._scaled_mm would first quantize the
activations (several small kernels per layer) and runs a GEMM tiled for large batches (on an H200
at one row it read a [6144 x 4096] fp8 weight at 0.75 TB/s); here one kernel reads each fp8
weight tile once, widens it to bfloat16 in registers and multiplies on the tensor cores, the
per-row scale applied at the end, and writes the output in the activation dtype. Narrow column
tiles give a [1 x 4096] x [4096 x 4096] product 256 programs, enough for every multiprocessor
without splitting the inner dimension (which would need a float32 buffer, zeroed and cast each
call: two more kernels per layer). Tile shapes are tuned per weight shape on the device at first
use (triton.autotune): under CUDA graphs that happens in the warm-up run before capture.

`kernel="gemv"` (up to GEMV_MAX_ROWS rows) takes the weight tile in its own row-major layout and
reduces along K with float32 multiply-adds instead of the tensor cores: no widening of the tile
into the dot operand's layout, at the cost of arithmetic that grows with the rows. Which of the two
reads fp8 faster at one row is for a GPU to say (benchmarks/gpu_check.py times both); "dot" stays
the default until one has.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shardserve.layers.gpu_kernels import dot_f32, dot_precision

MAX_ROWS = 16  # the kernel's row tile: larger batches take torch._scaled_mm (layers/quantization.py)
GEMV_MAX_ROWS = 4

_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
                                (64, 256, 4, 4), (16, 1024, 8, 2), (32, 128, 4, 5), (64, 512, 8, 3))]
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter checks the math, not the speed
    _CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _fp8_weight_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, x_row_stride,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + ks[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=col_valid[None, :] & k_valid[:, None],
                    other=0.0)  # [BLOCK_K, BLOCK_N] fp8
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    acc = acc * tl.load(scale_ptr + cols, mask=col_valid, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


_GEMV_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                 for n, k, w, st in ((4, 1024, 4, 4), (8, 512, 4, 4), (8, 1024, 4, 3), (16, 256, 4, 4),
                                     (16, 512, 8, 3), (32, 256, 8, 3), (4, 2048, 8, 3), (8, 256, 4, 5))]
if os.environ.get("TRITON_INTERPRET") == "1":
    _GEMV_CONFIGS = [triton.Config({"BLOCK_N": 8, "BLOCK_K": 32})]


@triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "ROWS"])
@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, x_row_stride,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, ROWS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=col_valid[:, None] & k_valid[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K], as stored
        for r in tl.static_range(ROWS):
            x = tl.load(x_ptr + r * x_row_stride + ks, mask=k_valid & (ks * 0 + r < M), other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == r, acc + part[None, :], acc)
    acc = acc * tl.load(scale_ptr + cols, mask=col_valid, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & col_valid[None, :])


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kernel: str = "dot") -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, or GEMV_MAX_ROWS with kernel="gemv"; unit stride along K) times fp8
    weight [N, K] (row-major) with per-row scales [N] float32 -> [M, N] in x's dtype."""
    num_rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if kernel == "gemv":
        _fp8_gemv_kernel[grid](x, weight, scale, out, num_rows, n, k, x.stride(0),
                               ROWS=triton.next_power_of_2(num_rows))
    else:
        _fp8_weight_kernel[grid](x, weight, scale, out, num_rows, n, k, x.stride(0), BLOCK_M=MAX_ROWS,
                                 DOT_F32=dot_f32(x.dtype), DOT_PRECISION=dot_precision(x.dtype))
    return out
