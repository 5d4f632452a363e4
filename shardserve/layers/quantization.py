"""Quantized linear weights, quantized once after loading: `--quantization fp8` and `int8`.

fp8: a linear layer's weight in float8 e4m3 with one scale per output row.

Decode reads every weight once a step, so halving the weights' bytes is what makes it faster: on
a GPU a step of up to 16 rows multiplies the bfloat16 activations by the fp8 weight directly
(gpu_kernels/fp8_linear.py). Larger batches, and every batch on a CPU (a reference path, for
tests), quantize the activations per token too and take `torch._scaled_mm` (cuBLASLt's fp8 GEMM
on Hopper and Ada), accumulated in float32 and written in the activation dtype. Per-row weight
scales and per-token activation scales (vLLM's dynamic "fp8" scheme for a bf16 checkpoint) keep
an outlier row or token from costing the others their precision. The LM head, the embedding and
MoE experts stay in the activation dtype.

int8: weight-only, in llama.cpp's Q8_0 layout (blocks of 32 inputs, one float scale each: 1.06
bytes a weight), for CPUs: csrc/int8_linear.cpp quantizes each activation row the same way and
sums exact int8 block dots (AVX512-VNNI), so a row's result does not depend on its batch.
Quantizing a dequantized Q8_0 GGUF tensor this way, from float32, gives back its blocks exactly
(the engine loads weights in the model dtype first, so a served Q8_0 GGUF is re-derived from bf16:
close to, not yet exactly, its file's blocks). On the Zen 4 test host SmolLM2 decodes a little
faster with it at batch 1 than in bf16 (90-120 against 81-107 tok/s), half as fast at batch 32.
"""
from __future__ import annotations

import torch

from shardserve.layers.cpu_kernels import load_int8_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8 [R, C], float32 scales [R, 1]) with x ~= q * scale, row by row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _decode_kernels():
    """The weight-only decode kernels' module (gpu_kernels/fp8_linear.py), None without Triton."""
    from shardserve.layers.gpu_kernels import triton_available

    if not triton_available():
        return None
    from shardserve.layers.gpu_kernels import fp8_linear

    return fp8_linear


class Fp8Weight:
    """A Linear's weight [out, in] in fp8; `linear(x, bias)` is x W^T (+ b), as PackedWeight's."""

    fuses_silu_mul = False  # the panel kernel's fused SwiGLU is a CPU bf16/fp32 epilogue
    decode_kernel = "dot"  # fp8_linear's kernel for up to GEMV_MAX_ROWS rows: "dot" or "gemv"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        data, scale = quantize_rows(weight.detach())
        self.data = data  # [out, in] row-major: its transpose is the column-major operand _scaled_mm takes
        self.scale = scale.t().contiguous()  # [1, out]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        kernels = _decode_kernels() if rows.is_cuda else None
        if kernels is not None and rows.shape[0] <= kernels.MAX_ROWS:  # a decode step: weight-only, one kernel
            kernel = self.decode_kernel if rows.shape[0] <= kernels.GEMV_MAX_ROWS else "dot"
            y = kernels.fp8_weight_linear(rows.contiguous(), self.data, self.scale.view(-1), kernel)
        else:
            xq, x_scale = quantize_rows(rows)
            y = torch._scaled_mm(xq, self.data.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight these fp8 values and scales stand for, [out, in] float32 (for tests)."""
        return self.data.float() * self.scale.t()


INT8_BLOCK = 32


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (int8 [R, C_pad], float32 scales [R, C_pad / 32]): per block of 32 columns
    (zero-padded to a whole block), scale = max|x| / 127 and q = x / scale rounded to nearest."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % INT8_BLOCK)).view(rows, -1, INT8_BLOCK)
    scale = padded.abs().amax(dim=-1) / 127
    q = torch.where(scale.unsqueeze(-1) > 0, padded / scale.unsqueeze(-1), 0).round().clamp(-127, 127)
    return q.to(torch.int8).view(rows, -1), scale.contiguous()


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel computes, in float64: x's rows quantized per block as the weight's,
    exact block dots, scaled [N, out]."""
    x = x.reshape(-1, x.shape[-1])
    xq, dx = quantize_blocks(torch.nn.functional.pad(x, (0, q.shape[1] - x.shape[1])))  # zero blocks past `in`
    blocks = q.shape[1] // INT8_BLOCK
    dots = torch.einsum("nbi,obi->nob", xq.view(-1, blocks, INT8_BLOCK).double(), q.view(-1, blocks, INT8_BLOCK).double())
    return (dots * dx.double().unsqueeze(1) * scale.double().unsqueeze(0)).sum(-1)


class Int8Weight:
    """A Linear's weight [out, in] as int8 blocks of 32 with float32 scales; `linear(x, bias)`
    is x W^T (+ b), as PackedWeight's. Stored packed for the kernel: rows padded to a multiple
    of 4 and columns to one of 64 (zero blocks), each group of 4 rows interleaved two blocks at a
    time (csrc/int8_linear.cpp)."""

    fuses_silu_mul = False

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        padded = torch.nn.functional.pad(weight.detach(), (0, -self.in_features % 64, 0, -self.out_features % 4))
        q, scale = quantize_blocks(padded)
        rows, blocks = scale.shape
        groups, pairs = rows // 4, blocks // 2
        self.data = q.view(groups, 4, pairs, 64).transpose(1, 2).contiguous()  # [groups][pairs][4 rows][64]
        self.scale = scale.view(groups, 4, pairs, 2).transpose(1, 2).contiguous()  # [groups][pairs][4 rows][2]
        # the kernel feeds x as xq + 128 (unsigned bytes): each block's 128 * sum(wq), scaled, comes off
        self.offset = (scale * 128 * q.view(rows, blocks, INT8_BLOCK).sum(-1)).contiguous()
        self.kernel = load_int8_linear() if weight.device.type == "cpu" else None

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks row-major: (int8 [out_pad, in_pad], float32 scales [out_pad, in_pad / 32])."""
        groups, pairs = self.data.shape[:2]
        return (self.data.transpose(1, 2).reshape(groups * 4, pairs * 64),
                self.scale.transpose(1, 2).reshape(groups * 4, pairs * 2))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel is not None:
            y = self.kernel(rows, self.data, self.scale, self.offset, bias, self.out_features)
        else:  # no toolchain (or not a CPU): the reference arithmetic
            y = int8_linear_reference(rows, *self.blocks())[:, : self.out_features].to(x.dtype)
            if bias is not None:
                y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight these blocks stand for, [out, in] float32 (for tests)."""
        q, scale = self.blocks()
        values = q.view(len(q), -1, INT8_BLOCK).float() * scale.unsqueeze(-1)
        return values.view(len(q), -1)[: self.out_features, : self.in_features]
