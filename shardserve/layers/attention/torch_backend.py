"""The reference attention backend: torch ops only, on any device.

Decodes are sorted by context length (the runner packs them longest first) and attended in a few
groups, each one batched call over block tables padded to the group's longest context (one group
when lengths are alike; more when they differ, so a short sequence does not pay for the longest
one's padding). Each prefill chunk is attended on its own (a chunk is large enough that the
per-call overhead does not matter); the CPU backend shares that prefill path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardserve.layers.attention.paged_kv import (
    PagedCache, SeqSpan, cache_rows, gather_rows, padded_block_tables, slot_mapping, write_kv,
)
from shardserve.layers.rotary import apply_rotary


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
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttention:
    name = "torch"

    def build_metadata(self, spans: list[SeqSpan], num_decodes: int, cache: PagedCache) -> TorchAttentionMetadata:
        slots = torch.tensor(slot_mapping(spans, cache.block_size), dtype=torch.long, device=cache.device)
        meta = TorchAttentionMetadata(slots, prefills=prefill_chunks(spans, num_decodes, cache))
        decodes = spans[:num_decodes]
        block_counts = [s.start_pos // cache.block_size + 1 for s in decodes]
        for start, end in split_by_length(block_counts):
            meta.decode_groups.append(DecodeGroup(start, end, *_decode_tables(decodes[start:end], cache)))
        return meta

    def forward(self, qkv, cos_sin, kv_cache, meta: TorchAttentionMetadata, num_heads: int, scale: float) -> torch.Tensor:
        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        # rotate queries and keys in one pass: they are adjacent heads of the fused projection
        qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], cos_sin)  # [T, H + KV, D]
        q, k, v = qk[:, :num_heads], qk[:, num_heads:], qkv[:, num_heads + num_kv_heads :]
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        if not meta.prefills and len(meta.decode_groups) == 1:  # no output buffer to assemble
            return _decode_attention(q, kv_cache[0], kv_cache[1], meta.decode_groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            s, e = group.token_start, group.token_end
            out[s:e] = _decode_attention(q[s:e], kv_cache[0], kv_cache[1], group, scale)
        attend_prefills(out, q, k, v, kv_cache, meta.prefills, scale)
        return out


def prefill_chunks(spans: list[SeqSpan], num_decodes: int, cache: PagedCache) -> list[PrefillChunk]:
    """The prefill chunks `spans[num_decodes:]`, placed after the decodes' tokens."""
    chunks, token_start = [], num_decodes
    for span in spans[num_decodes:]:
        rows = None
        if span.start_pos > 0:  # earlier tokens (a prefix-cache hit or an earlier chunk) are cached
            rows = cache_rows(span.block_ids[: -(-span.context_len // cache.block_size)], cache)
        chunks.append(PrefillChunk(token_start, token_start + span.num_tokens, span.context_len, rows))
        token_start += span.num_tokens
    return chunks


def attend_prefills(out, q, k, v, kv_cache, prefills: list[PrefillChunk], scale: float) -> None:
    """Write each chunk's attention output into its rows of `out`."""
    for chunk in prefills:
        s, e = chunk.token_start, chunk.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], kv_cache[0], kv_cache[1], chunk, scale)


def _decode_tables(decodes: list[SeqSpan], cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows of the padded block tables [KV * B * max_blocks] and the additive mask
    [KV * B, 1, max_blocks * bs] that hides the padding."""
    tables, context_lens = padded_block_tables(decodes, cache.block_size)
    num_slots = len(tables[0]) * cache.block_size
    visible = torch.arange(num_slots).unsqueeze(0) < torch.tensor(context_lens).unsqueeze(1)  # [B, L]
    bias = torch.zeros(visible.shape, dtype=cache.dtype).masked_fill_(~visible, float("-inf"))
    bias = bias.unsqueeze(1).repeat(cache.num_kv_heads, 1, 1)  # [KV * B, 1, L]
    return cache_rows(tables, cache), bias.to(cache.device)


def _decode_attention(q, k_cache, v_cache, meta: DecodeGroup, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    # [KV * B * max_blocks, bs * D] -> [KV * B, L, D] with L = max_blocks * bs
    keys = gather_rows(k_cache, meta.gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    values = gather_rows(v_cache, meta.gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    # [B, H, D] -> [KV * B, G, D]: the G query heads sharing a KV head attend as G query rows.
    grouped_q = q.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
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
        keys = gather_rows(k_cache, chunk.gather_ids).view(num_kv_heads, -1, head_dim)[:, : chunk.context_len]
        values = gather_rows(v_cache, chunk.gather_ids).view(num_kv_heads, -1, head_dim)[:, : chunk.context_len]
        # query i sits at absolute position context_len - num_tokens + i
        offset = chunk.context_len - num_tokens
        mask = torch.ones(num_tokens, chunk.context_len, dtype=torch.bool, device=q.device).tril(diagonal=offset)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)


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
