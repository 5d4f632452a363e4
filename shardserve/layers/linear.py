"""Linear layers whose weights may be assembled from several checkpoint tensors.

Checkpoints store q/k/v and gate/up as separate matrices; we fuse them into one matmul each.
Every parameter carries a `weight_loader(param, tensor, shard_id)` that knows where a checkpoint
tensor goes, so the model's `load_weights` is a name mapping and nothing else. A layer may hold
only a slice of each checkpoint matrix (`row_starts`, `input_slice`: a tensor-parallel rank's
share, see shardserve/parallel/linear.py); its loader then reads just that slice.

On CPU, weights are repacked once, after loading, for the fastest kernel there: our own panel
kernel (csrc/panel_linear.cpp) where the CPU has one for the dtype (AMX: bfloat16 on tiles, 1.9-2.3
TFLOP/s on 2 Sapphire Rapids cores from 32 rows up, 0.8-2.1x oneDNN's AMX path, 2.4x it at 8 rows;
AVX-512: bfloat16 and float32, at decode batch sizes 1.5x and 1.3x faster than oneDNN; AVX2 with
FMA: float32, 1.2-1.9x at 8 rows, 1.15-1.4x at 32, 0.83-1.06x from 128 rows up), otherwise
oneDNN's blocked layout (a plain `F.linear` re-lays the weight out on every call, which costs
1.5-3x at decode batch sizes). One kernel for every row count keeps a row's result independent of
the batch it is in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.block_quant import BlockWeight, ConcatBlockWeight, RawBlocks
from shardserve.layers.cpu_kernels import load_panel_linear
from shardserve.layers.lazy_tensor import LazyTensor, as_lazy
from shardserve.layers.quantization import Fp8Weight, int8_weight


def default_weight_loader(param: torch.Tensor, tensor: "torch.Tensor | LazyTensor", shard_id=None) -> None:
    copy_checked(param.data, as_lazy(tensor).read())


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


class PackedWeight:
    """A weight [out, in] repacked for one CPU matmul kernel; `linear(x, bias)` is x W^T (+ b).
    With the panel kernel's fused epilogues (`fused`), also `linear_float` (the same values in
    float32, in the matmul's own pass) and, for a [gate; up] weight, `silu_mul` (SwiGLU of the
    two halves in the same pass: the bits of linear then silu_and_mul)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.panel_kernel = load_panel_linear(weight.dtype)
        self.fused = self.panel_kernel is not None and self.panel_kernel.epilogues()
        if self.panel_kernel is not None:
            self.data = self.panel_kernel.pack(weight.detach().contiguous())
            self.panel_linear = self.panel_kernel.linear.default  # the overload itself: no lookup per call
        else:
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)  # 32: decode batch hint

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panel_kernel is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        if x.dim() == 2:
            return self.panel_linear(x, self.data, bias, self.out_features)
        y = self.panel_linear(x.reshape(-1, x.shape[-1]), self.data, bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """linear(x, None).float() for x [N, in]."""
        if not self.fused:
            return self.linear(x, None).float()
        return self.panel_kernel.linear_float.default(x, self.data, None, self.out_features)

    def linear_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """linear_float(x).argmax(dim=-1) for x [N, in], int64 [N]; with the fused epilogue the
        [N, out] float32 values are never written (an LM head's greedy tokens)."""
        if not self.fused:
            return self.linear_float(x).argmax(dim=-1)
        return self.panel_kernel.linear_argmax.default(x, self.data, None, self.out_features)

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether silu_mul runs fused: the kernel has the epilogue and each half is whole panels."""
        return self.fused and self.out_features % 64 == 0

    @property
    def gathers_rows(self) -> bool:
        """Whether `rows` can read W's rows back (the panel layout; oneDNN's is opaque)."""
        return self.panel_kernel is not None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, in], bit for bit, read from the panels ([out / P][in_pad / kw][P][kw], P
        output rows a panel): a tied embedding looks its tokens up here instead of keeping its
        own copy of the matrix."""
        panel_rows = self.data.shape[2]
        picked = self.data[ids // panel_rows, :, ids % panel_rows, :]  # [T, in_pad / kw, kw]
        return picked.reshape(ids.shape[0], -1)[:, : self.in_features].contiguous()

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(linear(x, None)) for x [N, in] and a fused [gate; up] weight (fuses_silu_mul)."""
        return self.panel_kernel.linear_silu_mul.default(x, self.data, self.out_features // 2)


def prepack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The weight repacked for this CPU's fastest kernel, or None where no packed path applies."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if load_panel_linear(weight.dtype) is None and not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(weight)
    except (RuntimeError, AttributeError):  # a torch build without oneDNN's reorder op
        return None


class Linear(nn.Module):
    """y = x W^T (+ b) where W's output rows are the concatenation of `output_sizes` shards.

    Shard i holds rows [row_starts[i], row_starts[i] + output_sizes[i]) of its checkpoint matrix
    (default: all of them), and columns `input_slice` = (start, length) (default: all)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 row_starts: list[int] | None = None, input_slice: tuple[int, int] | None = None):
        super().__init__()
        self.output_sizes = output_sizes
        self.row_starts = row_starts  # None: whole checkpoint matrices
        self.input_slice = input_slice  # None: all columns
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_shard
        self.packed: PackedWeight | Fp8Weight | BlockWeight | ConcatBlockWeight | None = None
        self.keep_blocks = False  # `--quantization gguf`: keep a checkpoint's blocks (see _load_shard)
        self._blocks: dict[int, RawBlocks] = {}  # shard -> its blocks, until prepack
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, tensor: "torch.Tensor | LazyTensor", shard_id: int | None = None) -> None:
        """Copy this layer's slice of checkpoint tensor `shard_id` (None: the whole fused matrix)."""
        tensor = as_lazy(tensor)
        if param is self.weight and self.keep_blocks and tensor.blocks is not None:
            blocks = self._slice_blocks(tensor.blocks(), shard_id)
            if blocks is not None:
                self._blocks[shard_id or 0] = blocks
                return
        if param.dim() == 2 and self.input_slice is not None:
            data = tensor.narrow(1, *self.input_slice)  # row-parallel: our columns, all rows
        elif self.row_starts is not None:
            shard = shard_id or 0
            data = tensor.narrow(0, self.row_starts[shard], self.output_sizes[shard])
        else:
            data = tensor.read()
        start = sum(self.output_sizes[:shard_id]) if shard_id is not None else 0
        size = self.output_sizes[shard_id] if shard_id is not None else param.shape[0]
        copy_checked(param.data.narrow(0, start, size), data.to(param.dtype))

    def _slice_blocks(self, blocks: RawBlocks, shard_id: int | None) -> RawBlocks | None:
        """This layer's slice of a block-quantized checkpoint tensor, or None where the slice cuts
        blocks (a row-parallel share not a whole number of the format's blocks)."""
        if self.input_slice is not None:
            return blocks.narrow_cols(*self.input_slice)
        if self.row_starts is not None:
            shard = shard_id or 0
            return blocks.narrow_rows(self.row_starts[shard], self.output_sizes[shard])
        return blocks

    def prepack(self, quantization: str | None = None) -> None:
        """Switch to the packed weight (after loading), or to its `quantization` ("fp8", "int8":
        layers/quantization.py; "gguf": the checkpoint's own blocks, layers/block_quant.py); the
        plain copy is released."""
        blocks, self._blocks = self._blocks, {}
        if blocks:
            parts = [blocks.get(i) for i in range(len(self.output_sizes))]
            if all(p is not None for p in parts):
                same = all(p.qtype == parts[0].qtype for p in parts)
                self.packed = (BlockWeight(RawBlocks.cat_rows(parts)) if same
                               else ConcatBlockWeight([BlockWeight(p) for p in parts]))
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)
                return
            for i, part in blocks.items():  # a shard stored in float: one matmul, in the model dtype
                start = sum(self.output_sizes[:i])
                self.weight.data[start: start + self.output_sizes[i]] = part.dequantize().to(self.weight.dtype)
        if quantization == "fp8":
            self.packed = Fp8Weight(self.weight)
        else:  # int8: Q8_0 blocks, where the layer can hold them
            self.packed = (int8_weight(self.weight) if quantization == "int8" else None) or prepack_weight(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, bias)
        return F.linear(x, self.weight, bias)
