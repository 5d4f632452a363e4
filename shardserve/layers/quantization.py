"""fp8 weights (`--quantization fp8`): a linear layer's weight in float8 e4m3 with one scale per
output row, quantized once after loading.

Decode reads every weight once a step, so halving the weights' bytes is what makes it faster: on
a GPU a step of up to 16 rows multiplies the bfloat16 activations by the fp8 weight directly
(gpu_kernels/fp8_linear.py). Larger batches, and every batch on a CPU (a reference path, for
tests), quantize the activations per token too and take `torch._scaled_mm` (cuBLASLt's fp8 GEMM
on Hopper and Ada), accumulated in float32 and written in the activation dtype. Per-row weight
scales and per-token activation scales (vLLM's dynamic "fp8" scheme for a bf16 checkpoint) keep
an outlier row or token from costing the others their precision. The LM head, the embedding and
MoE experts stay in the activation dtype.
"""
from __future__ import annotations

import torch

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
