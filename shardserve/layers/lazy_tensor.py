"""A checkpoint tensor that has not been read yet: its shape, and a way to read all of it or one
slice. Tensor-parallel ranks read only their slice (safetensors reads just those bytes). A tensor
stored in GGUF blocks can also be read as those blocks, for layers that keep them
(`--quantization gguf`, layers/block_quant.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from shardserve.layers.block_quant import RawBlocks

# (dim, start, stop) -> tensor[..., start:stop, ...] along dim; dim None: the whole tensor
Reader = Callable[[int | None, int, int], torch.Tensor]


@dataclass(frozen=True)
class LazyTensor:
    shape: tuple[int, ...]
    reader: Reader
    blocks: "Callable[[], RawBlocks] | None" = None  # the stored blocks, for a block-quantized tensor

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "LazyTensor":
        """An already materialised tensor (GGUF dequantizes whole tensors, then slices)."""
        def read(dim, start, stop):
            return tensor if dim is None else tensor.narrow(dim, start, stop - start)
        return cls(tuple(tensor.shape), read)

    def read(self) -> torch.Tensor:
        return self.reader(None, 0, 0)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim < 0:
            dim += len(self.shape)
        if start == 0 and length == self.shape[dim]:
            return self.read()
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) of dim {dim} is outside shape {self.shape}")
        return self.reader(dim, start, start + length)


def as_lazy(tensor: "torch.Tensor | LazyTensor") -> LazyTensor:
    return tensor if isinstance(tensor, LazyTensor) else LazyTensor.of(tensor)
