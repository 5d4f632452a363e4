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

int8: weight-only, a float checkpoint's linears quantized to llama.cpp's Q8_0 blocks (32 inputs,
an fp16 scale, int8 values: 1.06 bytes a weight, as llama-quantize makes them) and multiplied by
the GGUF block kernel (layers/block_quant.py): a row's result does not depend on its batch.
Against s26's own int8 kernel, over SmolLM2's linears on the Zen 4 host: 1.25x faster at batch 1,
2x from batch 8 (4.0 / 6.7 / 19.1 / 78.7 ms at 1 / 8 / 32 / 128 rows against 5.0 / 13.7 / 41.6 /
156.5). A GGUF's own Q8_0 blocks are kept by `--quantization gguf` instead.
"""
from __future__ import annotations

import gguf
import torch
from gguf import GGMLQuantizationType as QType

from shardserve.layers.block_quant import BLOCK, BlockWeight, RawBlocks, kernels_available

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


def int8_weight(weight: torch.Tensor) -> BlockWeight | None:
    """`--quantization int8`: weight [out, in] in Q8_0 blocks for the block kernel, or None where
    they cannot hold it (inputs not a multiple of 32, not a CPU, no native kernels): that layer
    then stays in float."""
    if weight.device.type != "cpu" or weight.shape[1] % BLOCK or not kernels_available():
        return None
    raw = gguf.quants.quantize(weight.detach().float().numpy(), QType.Q8_0)
    return BlockWeight(RawBlocks(QType.Q8_0, torch.from_numpy(raw), weight.shape[1]))
