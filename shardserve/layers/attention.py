"""Attention over a paged KV cache.

Cache layout, per layer and for K and V alike::

    [num_kv_heads, num_blocks, block_size, head_dim]

Head-major so that gathering a batch's blocks yields `[num_kv_heads, batch, blocks_per_seq *
block_size, head_dim]`, ready for a batched matmul with no transpose copy. The gather is one
`index_select` on dim 0 of the `[num_kv_heads * num_blocks, block_size * head_dim]` view, with
row ids `kv_head * num_blocks + block_id` (several times faster on CPU than selecting on dim 1). A token at
position `p` of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened middle dims.

A step's packed tokens are ordered `[decodes (1 token each) | prefill chunks ...]`: decodes are
attended in one batched call over padded block tables; each prefill chunk is attended on its own
(a chunk is large enough that the per-call overhead does not matter).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
class AttentionMetadata:
    """Per-step tensors shared by every layer. Built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    num_decodes: int = 0
    decode_gather_ids: torch.Tensor | None = None  # [KV * num_decodes * max_blocks] cache rows, padded
    decode_bias: torch.Tensor | None = None  # [num_kv_heads * num_decodes, 1, max_blocks * block_size]
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
    if not meta.prefills:  # a pure decode step: no output buffer to assemble
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    # [KV * B * max_blocks, bs * D] -> [KV * B, L, D] with L = max_blocks * bs
    keys = _gather(k_cache, meta.decode_gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    values = _gather(v_cache, meta.decode_gather_ids).view(num_kv_heads * num_seqs, -1, head_dim)
    # [B, H, D] -> [KV * B, G, D]: the G query heads sharing a KV head attend as G query rows.
    grouped_q = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    scores = torch.baddbmm(meta.decode_bias, grouped_q, keys.transpose(1, 2), alpha=scale)  # [KV*B, G, L]
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
