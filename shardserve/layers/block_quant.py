"""Weights kept in llama.cpp's block formats (`--quantization gguf`): Q4_0, Q4_1, Q8_0, Q4_K and
Q6_K tensors of a GGUF file stay in their blocks, exactly as the file has them, repacked for
csrc/block_linear.cpp.

A decode step reads every weight once, so its time is the weights' bytes over memory bandwidth:
SmolLM2's Q4_1 file holds its linears in 0.625 bytes a weight, against 2 for the bfloat16 they
were dequantized to before. Activations are quantized per block of 32 as llama.cpp quantizes them
for its dot products (Q8_0: scale max|x| / 127, round to nearest), and every block dot is an
exact int32 sum (AVX512-VNNI), scaled once.

Q4_K keeps its 4-bit quants and 6-bit scales and mins as they are (a block's scale is formed in
the kernel), Q6_K its 6-bit quants and 8-bit scales, so every format holds about its file's
bytes. The kernel's layout puts 16 output rows side by side, block after block (see the kernel's
header); `pack` builds it from GGUF rows, `BlockWeight` multiplies by it and reads rows back out
(a tied embedding's lookup), and `block_linear_reference` is the arithmetic the tests compare the
kernel against.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
from gguf import GGMLQuantizationType as QType

from shardserve.layers.cpu_kernels import argmax_rows, load_block_linear

BLOCK = 32  # inputs per block of the kernel
GROUP_ROWS = 16
# GGUF type -> (the kernel's format id, inputs of one GGUF block, its bytes): the types
# `--quantization gguf` keeps in blocks; others are dequantized
FORMATS = {QType.Q4_0: (0, 32, 18), QType.Q4_1: (1, 32, 20), QType.Q8_0: (2, 32, 34), QType.Q4_K: (3, 256, 144),
           QType.Q6_K: (4, 256, 210)}


@dataclass(frozen=True)
class RawBlocks:
    """A GGUF tensor's rows of blocks as stored: uint8 [rows, blocks * block bytes], `cols` inputs."""

    qtype: QType
    data: torch.Tensor
    cols: int

    def narrow_rows(self, start: int, length: int) -> "RawBlocks":
        return RawBlocks(self.qtype, self.data.narrow(0, start, length), self.cols)

    def narrow_cols(self, start: int, length: int) -> "RawBlocks | None":
        """Inputs [start, start + length), or None unless both ends are on block boundaries."""
        _, size, nbytes = FORMATS[self.qtype]
        if start % size or length % size:
            return None
        return RawBlocks(self.qtype, self.data.narrow(1, start // size * nbytes, length // size * nbytes), length)

    def permute_rows(self, order: torch.Tensor) -> "RawBlocks":
        return RawBlocks(self.qtype, self.data[order], self.cols)

    @staticmethod
    def cat_rows(parts: list["RawBlocks"]) -> "RawBlocks":
        return RawBlocks(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], llama.cpp's values (the gguf package dequantizes)."""
        return torch.from_numpy(gguf.quants.dequantize(self.data.numpy(), self.qtype)).reshape(-1, self.cols)


def pack(raw: RawBlocks) -> torch.Tensor:
    """GGUF rows -> the kernel's layout, uint8 [ceil(rows / 16), stream]: per 16 rows and block,
    the 16 fp16 scales d (then the 16 minimums m for Q4_1), then the quants, register j holding
    inputs 4j..4j+3 of the 16 rows (the 4-bit formats' byte i pairs inputs i and i + 16, which the
    kernel splits into registers k and 4 + k). Q4_K: see _pack_q4_k."""
    _, size, nbytes = FORMATS[raw.qtype]
    rows, blocks = raw.data.shape[0], raw.cols // size
    groups = -(-rows // GROUP_ROWS)
    data = torch.nn.functional.pad(raw.data, (0, 0, 0, groups * GROUP_ROWS - rows))  # zero rows: d = 0
    b = data.reshape(groups, GROUP_ROWS, blocks, nbytes).transpose(1, 2)  # [G, B, 16 rows, block]
    if raw.qtype == QType.Q4_K:
        return _pack_q4_k(b)
    if raw.qtype == QType.Q6_K:
        return _pack_q6_k(b)
    parts = [b[..., 0:2]]
    if raw.qtype == QType.Q8_0:
        qs = (b[..., 2:] ^ 0x80).reshape(groups, blocks, GROUP_ROWS, 8, 4)  # q + 128: unsigned for vpdpbusd
    else:
        if raw.qtype == QType.Q4_1:
            parts.append(b[..., 2:4])
        qs = b[..., -16:].reshape(groups, blocks, GROUP_ROWS, 4, 4)
    scales = [p.reshape(groups, blocks, 2 * GROUP_ROWS) for p in parts]
    return torch.cat([*scales, _registers(qs)], dim=-1).reshape(groups, -1).contiguous()


def _registers(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 rows, registers, 4 bytes] -> [..., registers x 16 rows x 4 bytes]."""
    return qs.transpose(-3, -2).reshape(*qs.shape[:-3], -1)


def _pack_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [G, S, 16 rows, 144 bytes] -> per 16 rows and super-block: d and dmin
    (fp16, 16 each), each of its 8 blocks' 6-bit scales then mins (a byte each, 16 + 16), then the
    8 blocks' quants as the other 4-bit formats have theirs (the file pairs inputs i and i + 32 of
    each 64 in a byte; the kernel wants i and i + 16 of each 32)."""
    groups, supers = b.shape[:2]
    head = b[..., 4:16].long()  # get_scale_min_k4's 12 bytes
    low6 = head & 63
    scales = torch.cat([low6[..., 0:4], (head[..., 8:12] & 15) | ((head[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([low6[..., 4:8], (head[..., 8:12] >> 4) | ((head[..., 4:8] >> 6) << 4)], dim=-1)
    qs = b[..., 16:].reshape(groups, supers, GROUP_ROWS, 4, 32)  # [.., chunk of 64, byte]
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(groups, supers, GROUP_ROWS, 8, 32)  # [.., block, input]
    paired = (q[..., :16] | (q[..., 16:] << 4)).reshape(groups, supers, GROUP_ROWS, 8, 4, 4)
    quants = _registers(paired.permute(0, 1, 3, 2, 4, 5))  # [G, S, block, 4 registers x 16 rows x 4]
    sm = torch.stack([scales, mins], dim=-1).permute(0, 1, 3, 4, 2).to(torch.uint8)  # [G, S, block, 2, 16 rows]
    parts = [b[..., 0:2].reshape(groups, supers, 32), b[..., 2:4].reshape(groups, supers, 32),
             sm.reshape(groups, supers, -1), quants.reshape(groups, supers, -1)]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def _pack_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [G, S, 16 rows, 210 bytes] -> per 16 rows and super-block: d (fp16, 16),
    the 16 int8 scales of each row's 16-input halves (half-major), then per block of 32 its low 4
    bits paired as the 4-bit formats pair them and its high 2 bits in two 64-byte planes (lane L
    of plane p: at bits 2k the high bits of register 4p + k's lane L)."""
    groups, supers = b.shape[:2]
    ql, qh = b[..., 0:128].reshape(groups, supers, GROUP_ROWS, 2, 64), b[..., 128:192].reshape(groups, supers, GROUP_ROWS, 2, 32)
    quarters = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    q = torch.stack(quarters, dim=-2).reshape(groups, supers, GROUP_ROWS, 8, 32)  # [.., row, block, input] 0..63
    low, high = q & 15, q >> 4
    paired = (low[..., :16] | (low[..., 16:] << 4)).reshape(groups, supers, GROUP_ROWS, 8, 4, 4)
    low_regs = _registers(paired.permute(0, 1, 3, 2, 4, 5))  # [G, S, block, 256]
    h = high.reshape(groups, supers, GROUP_ROWS, 8, 2, 4, 4)  # [.., row, block, plane, k, e]
    planes = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)  # [.., row, block, plane, e]
    high_regs = planes.permute(0, 1, 3, 4, 2, 5).reshape(groups, supers, 8, -1)  # [G, S, block, plane x row x e]
    scales = b[..., 192:208].permute(0, 1, 3, 2).reshape(groups, supers, -1)  # [G, S, half-block x row]
    parts = [b[..., 208:210].reshape(groups, supers, 32), scales,
             torch.cat([low_regs, high_regs], dim=-1).reshape(groups, supers, -1)]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, in] -> (xq float64 [N, B, 32], dx float64 [N, B, 1]) as the kernel quantizes rows:
    dx = max|x| / 127 per block and xq = x * (1 / dx) rounded to nearest even (float32 arithmetic)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (xb * inv).round().clamp(-127, 127).double(), d.double()


def block_linear_reference(x: torch.Tensor, raw: RawBlocks) -> torch.Tensor:
    """What the kernel computes, in float64: x's rows quantized per block, exact block dots with the
    quantized weight, scaled: [N, rows]."""
    xq, dx = quantize_activations(x.reshape(-1, x.shape[-1]))
    w = raw.dequantize().double().view(raw.data.shape[0], -1, BLOCK)  # d (q - 8), d q + m, d q
    return torch.einsum("nbi,obi,nb->no", xq, w, dx.squeeze(-1))


class BlockWeight:
    """A Linear's (or an LM head's) weight [out, in] in GGUF blocks; `linear(x, bias)` is x W^T (+ b)
    through csrc/block_linear.cpp, as PackedWeight's. Needs the native kernels (no torch fallback:
    without a compiler the loader dequantizes instead, `kernels_available`)."""

    fuses_silu_mul = False
    gathers_rows = True

    def __init__(self, raw: RawBlocks):
        kernels = load_block_linear()
        if kernels is None:
            raise RuntimeError("GGUF blocks need the native CPU kernels (csrc/block_linear.cpp)")
        self.kernel, self.rows_kernel = kernels.block_linear.default, kernels.block_rows.default
        self.qtype = raw.qtype
        self.format = FORMATS[raw.qtype][0]
        self.out_features, self.in_features = raw.data.shape[0], raw.cols
        self.data = pack(raw)
        self.dtype = torch.bfloat16  # of what `rows` returns; the model sets its own

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return self.kernel(x, self.data, self.format, bias, self.out_features, False)
        y = self.kernel(x.reshape(-1, x.shape[-1]), self.data, self.format, bias, self.out_features, False)
        return y.view(*x.shape[:-1], self.out_features)

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """linear(x, None) in float32 for x [N, in] (an LM head's logits)."""
        return self.kernel(x, self.data, self.format, None, self.out_features, True)

    def linear_argmax(self, x: torch.Tensor) -> torch.Tensor:
        return argmax_rows(self.linear_float(x))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, in] in `dtype`, dequantized from the blocks (an embedding's lookup)."""
        return self.rows_kernel(self.data, self.format, ids, self.in_features, self.dtype)


class ConcatBlockWeight:
    """A fused weight whose shards came in different formats (llama.cpp's _M files keep attn_v in
    another type than attn_q and attn_k): one BlockWeight a shard, their outputs side by side."""

    fuses_silu_mul = False

    def __init__(self, parts: list[BlockWeight]):
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([p.linear(x, None) for p in self.parts], dim=-1)
        return y if bias is None else y + bias


def kernels_available() -> bool:
    """Whether GGUF blocks can be kept (the native kernels built)."""
    return load_block_linear() is not None
