"""The paged KV cache's layout, and the index arithmetic every backend shares.

Per layer, for K and V alike::

    [num_kv_heads, num_blocks, block_size, head_dim]

Head-major so that gathering a batch's blocks yields `[num_kv_heads, batch, blocks_per_seq *
block_size, head_dim]`, ready for a batched matmul with no transpose copy. The gather is one
`index_select` on dim 0 of the `[num_kv_heads * num_blocks, block_size * head_dim]` view, with
row ids `kv_head * num_blocks + block_id` (several times faster on CPU than selecting on dim 1).
A token at position `p` of a sequence lives at slot

    block_table[p // block_size] * block_size + p % block_size

of the flattened middle dims.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVShape:
    """What one rank caches: its layers (a pipeline stage's) and its KV heads (a tp slice)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * block_size * torch.finfo(dtype).bits // 8


class PagedCache(Protocol):
    """The cache geometry a backend needs to build its metadata (engine/kv_cache.py's KVCache)."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's new tokens in the packed step: positions `[start_pos, start_pos +
    num_tokens)`, cached in the blocks `block_ids` (its whole block table). A step packs its
    decodes first (one token each, longest context first), then its prefill chunks."""

    start_pos: int
    num_tokens: int
    block_ids: list[int]

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


def slot_mapping(spans: list[SeqSpan], block_size: int) -> list[int]:
    """The cache slot of every new token, in packed order."""
    slots: list[int] = []
    for span in spans:
        for pos in range(span.start_pos, span.context_len):
            slots.append(span.block_ids[pos // block_size] * block_size + pos % block_size)
    return slots


def padded_block_tables(decodes: list[SeqSpan], block_size: int) -> tuple[list[list[int]], list[int]]:
    """Block tables padded with block 0 to the longest context, and the context lengths."""
    context_lens = [s.context_len for s in decodes]
    max_blocks = -(-max(context_lens) // block_size)
    tables = [s.block_ids[:max_blocks] + [0] * (max_blocks - len(s.block_ids[:max_blocks])) for s in decodes]
    return tables, context_lens


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values. k, v: [T, KV, D]; caches: [KV, num_blocks, block_size, D]."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def gather_rows(cache: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """cache [KV, num_blocks, bs, D] -> the rows `row_ids` of its [KV * num_blocks, bs * D] view."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, row_ids)


def gather_ids(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids [N] -> cache rows [KV * N], head-major: kv * num_blocks + block."""
    heads = torch.arange(num_kv_heads, device=block_ids.device).unsqueeze(1) * num_blocks
    return (heads + block_ids.unsqueeze(0)).view(-1)


def cache_rows(block_ids: list, cache: PagedCache) -> torch.Tensor:
    """Cache rows of `block_ids` (a list, or a list of equal-length lists), on the cache's device."""
    ids = torch.tensor(block_ids, dtype=torch.long).view(-1)
    return gather_ids(ids, cache.num_kv_heads, cache.num_blocks).to(cache.device)
