"""Weights kept in llama.cpp's block formats (`--quantization gguf`): Q4_0, Q4_1 and Q8_0 tensors of
a GGUF file stay in their blocks, exactly as the file has them, repacked for csrc/block_linear.cpp.

A decode step reads every weight once, so its time is the weights' bytes over memory bandwidth:
SmolLM2's Q4_1 file holds its linears in 0.625 bytes a weight, against 2 for the bfloat16 they
were dequantized to before. Activations are quantized per block of 32 as llama.cpp quantizes them
for its dot products (Q8_0: scale max|x| / 127, round to nearest), and every block dot is an
exact int32 sum (AVX512-VNNI), scaled once.

The kernel's layout puts 16 output rows side by side, block after block (see the kernel's header);
`BlockWeight` packs GGUF rows into it, reads rows back out (a tied embedding's lookup) and has the
reference arithmetic the tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QType

from shardserve.layers.cpu_kernels import load_block_linear

BLOCK = 32
GROUP_ROWS = 16
# GGUF type -> (the kernel's format id, bytes of one GGUF block, bytes of its scales in the packed layout)
FORMATS = {QType.Q4_0: (0, 18, 32), QType.Q4_1: (1, 20, 64), QType.Q8_0: (2, 34, 32)}
KEPT_TYPES = frozenset(FORMATS)  # the types `--quantization gguf` keeps in blocks; others are dequantized


@dataclass(frozen=True)
class RawBlocks:
    """A GGUF tensor's rows of blocks as stored: uint8 [rows, blocks * block bytes], `cols` inputs."""

    qtype: QType
    data: torch.Tensor
    cols: int

    @property
    def block_bytes(self) -> int:
        return FORMATS[self.qtype][1]

    def narrow_rows(self, start: int, length: int) -> "RawBlocks":
        return RawBlocks(self.qtype, self.data.narrow(0, start, length), self.cols)

    def narrow_cols(self, start: int, length: int) -> "RawBlocks | None":
        """Inputs [start, start + length), or None unless both ends are on block boundaries."""
        if start % BLOCK or length % BLOCK:
            return None
        bb = self.block_bytes
        return RawBlocks(self.qtype, self.data.narrow(1, start // BLOCK * bb, length // BLOCK * bb), length)

    def permute_rows(self, order: torch.Tensor) -> "RawBlocks":
        return RawBlocks(self.qtype, self.data[order], self.cols)

    @staticmethod
    def cat_rows(parts: list["RawBlocks"]) -> "RawBlocks":
        return RawBlocks(parts[0].qtype, torch.cat([p.data for p in parts]), parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], as llama.cpp dequantizes these blocks."""
        rows = self.data.shape[0]
        blocks = self.data.reshape(rows, -1, self.block_bytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, B, 1]
        if self.qtype == QType.Q8_0:
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            values = q * d
        else:
            qs = blocks[..., -16:]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # elements 0..15 low nibbles, 16..31 high
            if self.qtype == QType.Q4_0:
                values = (q - 8) * d
            else:
                values = q * d + blocks[..., 2:4].contiguous().view(torch.float16).float()
        return values.reshape(rows, self.cols)


def pack(raw: RawBlocks) -> torch.Tensor:
    """GGUF rows -> the kernel's layout, uint8 [ceil(rows / 16), blocks * stride]: per 16 rows and
    block, the 16 fp16 scales d (then the 16 minimums m for Q4_1), then the quants, register j
    holding inputs 4j..4j+3 of the 16 rows (the 4-bit formats' byte i already pairs inputs i and
    i + 16, which the kernel splits into registers k and 4 + k)."""
    _, bb, _ = FORMATS[raw.qtype]
    rows, blocks = raw.data.shape[0], raw.cols // BLOCK
    groups = -(-rows // GROUP_ROWS)
    data = torch.nn.functional.pad(raw.data, (0, 0, 0, groups * GROUP_ROWS - rows))  # zero rows: d = 0
    b = data.reshape(groups, GROUP_ROWS, blocks, bb).transpose(1, 2)  # [G, B, 16 rows, block]
    parts = [b[..., 0:2]]
    if raw.qtype == QType.Q8_0:
        qs = (b[..., 2:] ^ 0x80).reshape(groups, blocks, GROUP_ROWS, 8, 4)  # q + 128: unsigned for vpdpbusd
    else:
        if raw.qtype == QType.Q4_1:
            parts.append(b[..., 2:4])
        qs = b[..., -16:].reshape(groups, blocks, GROUP_ROWS, 4, 4)
    scales = [p.reshape(groups, blocks, 2 * GROUP_ROWS) for p in parts]
    quants = qs.permute(0, 1, 3, 2, 4).reshape(groups, blocks, -1)  # [G, B, register, row, 4 bytes]
    return torch.cat([*scales, quants], dim=-1).reshape(groups, -1).contiguous()


def unpack_rows(packed: torch.Tensor, qtype: QType, cols: int, ids: torch.Tensor) -> RawBlocks:
    """The GGUF rows `ids` back out of `pack`'s layout (pack's inverse, row by row)."""
    _, bb, scale_bytes = FORMATS[qtype]
    blocks = cols // BLOCK
    g = packed.view(packed.shape[0], blocks, -1)[ids // GROUP_ROWS]  # [T, B, stride]
    r = (ids % GROUP_ROWS).view(-1, 1, 1)
    take = lambda t, width: t.view(len(ids), blocks, GROUP_ROWS, width).gather(  # noqa: E731
        2, r.unsqueeze(-1).expand(-1, blocks, 1, width)).squeeze(2)
    parts = [take(g[..., 0:32], 2)]
    if qtype == QType.Q4_1:
        parts.append(take(g[..., 32:64], 2))
    quants = g[..., scale_bytes:]
    registers = 8 if qtype == QType.Q8_0 else 4
    q = quants.view(len(ids), blocks, registers, GROUP_ROWS, 4).transpose(2, 3)  # [T, B, row, register, 4]
    q = q.gather(2, r.view(-1, 1, 1, 1, 1).expand(-1, blocks, 1, registers, 4)).reshape(len(ids), blocks, -1)
    if qtype == QType.Q8_0:
        q = q ^ 0x80
    data = torch.cat([*parts, q], dim=-1).reshape(len(ids), blocks * bb)
    return RawBlocks(qtype, data, cols)


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
    through csrc/block_linear.cpp, as PackedWeight's."""

    fuses_silu_mul = False
    gathers_rows = True

    def __init__(self, raw: RawBlocks):
        self.qtype = raw.qtype
        self.format = FORMATS[raw.qtype][0]
        self.out_features, self.in_features = raw.data.shape[0], raw.cols
        self.data = pack(raw)
        kernels = load_block_linear()
        self.kernel = None if kernels is None else kernels.block_linear.default
        self.rows_kernel = None if kernels is None else kernels.block_rows.default
        self.dtype = torch.bfloat16  # of what `rows` returns; the model sets its own

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel is not None:
            return self.kernel(rows, self.data, self.format, bias, self.out_features, float_out)
        y = block_linear_reference(rows, self.raw())  # no toolchain: the reference arithmetic
        if bias is not None:
            y = y + bias.double()
        return y.to(torch.float32 if float_out else x.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and self.kernel is not None:  # the decode loop's case, without the reshapes
            return self.kernel(x, self.data, self.format, bias, self.out_features, False)
        return self._run(x, bias, False).view(*x.shape[:-1], self.out_features)

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, True)

    def linear_argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_float(x).argmax(dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, in] in `dtype`, dequantized from the blocks (an embedding's lookup)."""
        if self.rows_kernel is not None:
            return self.rows_kernel(self.data, self.format, ids, self.in_features, self.dtype)
        return unpack_rows(self.data, self.qtype, self.in_features, ids).dequantize().to(self.dtype)

    def raw(self) -> RawBlocks:
        """Every row back as GGUF blocks."""
        return unpack_rows(self.data, self.qtype, self.in_features, torch.arange(self.out_features))
