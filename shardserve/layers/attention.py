"""Attention over a paged KV cache.

Cache layout, per layer and for K and V alike::

    [num_kv_heads, num_blocks, block_size, head_dim]

Head-major so that gathering a batch's blocks yields `[num_kv_heads, batch, blocks_per_seq *
block_size, head_dim]`, ready for a batched matmul with no transpose copy. The gather is one
`index_select` on dim 0 of the `[num_kv_heads * num_blocks, block_size * head_dim]` view, with
row ids `kv_head * num_blocks + block_id` (several times faster on CPU than selecting on dim 1). A token at
position `p` of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened middle dims.

A step's packed tokens are ordered `[decodes (1 token each) | prefill chunks ...]`. On CPU the
decodes go to a native kernel (csrc/paged_decode_attention.cpp) that reads keys and values in
place. Otherwise (GPU, or no compiler) they are sorted by context length and attended in a few groups, each one batched call over block tables
padded to the group's longest context (one group when lengths are alike; more when they differ,
so a short sequence does not pay for the longest one's padding). Each prefill chunk is attended
on its own (a chunk is large enough that the per-call overhead does not matter).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens `[token_start, token_end)` in the packed batch.
    `context_len` counts all tokens of the sequence up to and including this chunk."""

    token_start: int
    token_end: int
    context_len: int
    gather_ids: torch.Tensor | None  # [KV * num_blocks] cache rows; None when the chunk is the whole context

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class DecodeGroup:
    """Decode tokens `[token_start, token_end)` (one per sequence) attended in one batch."""

    token_start: int
    token_end: int
    gather_ids: torch.Tensor  # [KV * num_seqs * max_blocks] cache rows of the padded block tables
    bias: torch.Tensor  # [KV * num_seqs, 1, max_blocks * block_size]: 0, or -inf over the padding


@dataclass
class NativeDecode:
    """Decode tokens `[0, num_seqs)` for the native CPU kernel, which reads the block pool directly
    (no gather, no padding): `kernel(q, k_cache, v_cache, block_table, context_lens, scale)`."""

    kernel: Callable
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor  # [num_seqs] int64


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer. Built by the model runner. Decodes use either
    `native_decode` or the torch path's `decode_groups`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native_decode: NativeDecode | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys/values. k, v: [T, KV, D]; caches: [KV, num_blocks, block_size, D]."""
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D] (this step's tokens, already rotated). Returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return attend(q, k, v, k_cache, v_cache, meta, scale)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """paged_attention once this step's keys and values are in the cache (a fused op stored them)."""
    native = meta.native_decode
    if native is not None:
        num_decodes = native.context_lens.shape[0]
        decoded = native.kernel(q[:num_decodes].contiguous(), k_cache, v_cache, native.block_table, native.context_lens, scale)
        if not meta.prefills:
            return decoded
    elif not meta.prefills and len(meta.decode_groups) == 1:  # no output buffer to assemble
        return _decode_attention(q, k_cache, v_cache, meta.decode_groups[0], scale)
    out = torch.empty_like(q)
    if native is not None:
        out[:num_decodes] = decoded
    for group in meta.decode_groups:
        s, e = group.token_start, group.token_end
        out[s:e] = _decode_attention(q[s:e], k_cache, v_cache, group, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(q, k_cache, v_cache, meta: DecodeGroup, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    # [KV * B * max_blocks, bs * D] -> [KV * B, L, D] with L = max_blocks * bs
    keys = _gather(k_cache, meta.gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    values = _gather(v_cache, meta.gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    # [B, H, D] -> [KV * B, G, D]: the G query heads sharing a KV head attend as G query rows.
    grouped_q = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    scores = torch.baddbmm(meta.bias, grouped_q, keys.transpose(1, 2), alpha=scale)  # [KV*B, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, values)  # [KV * B, G, D]
    return out.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    num_tokens = chunk.num_tokens
    if chunk.gather_ids is None:  # no earlier context: attend within the chunk, causally
        keys, values, mask = k.transpose(0, 1), v.transpose(0, 1), None
    else:  # earlier tokens (prefix-cache hit or an earlier chunk) come from the cache
        num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
        keys = _gather(k_cache, chunk.gather_ids).view(num_kv_heads, -1, head_dim)[:, : chunk.context_len]
        values = _gather(v_cache, chunk.gather_ids).view(num_kv_heads, -1, head_dim)[:, : chunk.context_len]
        # query i sits at absolute position context_len - num_tokens + i
        offset = chunk.context_len - num_tokens
        mask = torch.ones(num_tokens, chunk.context_len, dtype=torch.bool).tril(diagonal=offset)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
    """cache [KV, num_blocks, bs, D] -> the rows `row_ids` of its [KV * num_blocks, bs * D] view."""
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    return cache.view(num_kv_heads * num_blocks, block_size * head_dim).index_select(0, row_ids)


def gather_ids(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids [N] -> cache rows [KV * N], head-major: kv * num_blocks + block."""
    heads = torch.arange(num_kv_heads, device=block_ids.device).unsqueeze(1) * num_blocks
    return (heads + block_ids.unsqueeze(0)).view(-1)


def split_by_length(num_blocks_desc: list[int], max_groups: int = 4, max_waste: float = 0.25) -> list[tuple[int, int]]:
    """Split sequences sorted by block count (descending) into at most `max_groups` contiguous
    ranges, each padded to its first (longest) member with at most `max_waste` extra blocks."""
    ranges, start, n = [], 0, len(num_blocks_desc)
    while start < n:
        end, total = start + 1, num_blocks_desc[start]
        if len(ranges) == max_groups - 1:
            end = n
        while end < n and (end + 1 - start) * num_blocks_desc[start] <= (1 + max_waste) * (total + num_blocks_desc[end]):
            total += num_blocks_desc[end]
            end += 1
        ranges.append((start, end))
        start = end
    return ranges
