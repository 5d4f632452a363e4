"""Vocabulary-parallel embedding and LM head: rank r owns token ids [r V', (r+1) V') with
V' = ceil(V / tp) (the last rank's tail is padding).

    lookup:  ids [T] -> rows of ids we own, zeros elsewhere [T, hidden] --all_reduce--> [T, hidden]
    logits:  hidden [N, hidden] -> our vocab slice [N, V'] --all_gather--> [N, tp V'] -> [:, :V]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.block_quant import BlockWeight, RawBlocks
from shardserve.layers.linear import PackedWeight, copy_checked, prepack_weight
from shardserve.layers.lazy_tensor import LazyTensor, as_lazy
from shardserve.parallel.comm import all_gather, all_reduce
from shardserve.parallel.groups import GroupInfo


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: GroupInfo):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.num_local = -(-vocab_size // tp.size)
        self.start = tp.rank * self.num_local
        self.num_real = max(0, min(vocab_size - self.start, self.num_local))  # rows not padding
        # not zeros: untouched pages cost no memory, and a matrix loaded as blocks never touches them
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load
        self.shared: PackedWeight | BlockWeight | None = None  # rows looked up there, not in `weight`
        self.keep_blocks = False  # `--quantization gguf`: keep a checkpoint's blocks (layers/block_quant.py)

    def share_rows_of(self, packed: PackedWeight | None) -> None:
        """Look tokens up in `packed` (the tied LM head's packed copy of this very matrix) and
        release our own: the matrix is then held once. Tied heads are common in small models, whose
        vocabulary is a large part of them (SmolLM2-135M: 57 of 257 MB; Llama-3.2-1B: 525 MB)."""
        if packed is not None and packed.gathers_rows:
            self.shared = packed
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.shared is None else self.shared.rows(ids)

    def load(self, param: torch.Tensor, tensor: "torch.Tensor | LazyTensor", shard_id=None) -> None:
        tensor = as_lazy(tensor)
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocabulary of {self.vocab_size} vs checkpoint {tuple(tensor.shape)}")
        if self.keep_blocks and tensor.blocks is not None:
            raw = tensor.blocks().narrow_rows(self.start, self.num_real)
            padding = torch.zeros(self.num_local - self.num_real, raw.data.shape[1], dtype=torch.uint8)  # d = 0
            blocks = BlockWeight(RawBlocks(raw.qtype, torch.cat([raw.data, padding]), raw.cols))
            blocks.dtype = param.dtype
            self.take_blocks(blocks)
            self.weight.data = torch.empty(0, dtype=param.dtype)
            return
        rows = tensor.narrow(0, self.start, self.num_real)
        copy_checked(param.data[: self.num_real], rows.to(param.dtype))
        param.data[self.num_real:].zero_()  # the last tp rank's padding rows

    def take_blocks(self, blocks: BlockWeight) -> None:
        """Hold the matrix as `blocks` (looked up from there)."""
        self.shared = blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        x = self.lookup(local.masked_fill(outside, 0))  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(x, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T over the full vocabulary, W split by vocabulary rows like the
    embedding (for tied weights, loaded from the same checkpoint tensor)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: GroupInfo):
        super().__init__(vocab_size, hidden_size, dtype, tp)
        self.packed: PackedWeight | BlockWeight | None = None

    def take_blocks(self, blocks: BlockWeight) -> None:
        self.packed = blocks

    def prepack(self) -> None:
        if self.packed is not None:  # loaded as blocks
            return
        self.packed = prepack_weight(self.weight)
        if self.packed is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        if self.packed is not None:
            local = self.packed.linear_float(hidden)  # [N, V'], widened in the matmul's own pass
        else:
            local = F.linear(hidden, self.weight).float()
        return all_gather(local, self.tp, dim=-1)[:, : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """forward(hidden).argmax(dim=-1) without the logits where this rank holds the whole
        vocabulary; None under tp (the logits' all_gather is a collective every rank joins)."""
        if self.tp.size > 1:
            return None
        if self.packed is not None:
            return self.packed.linear_argmax(hidden)
        return self.forward(hidden).argmax(dim=-1)
