"""Attention over the paged KV cache (layout: layers/attention/paged_kv.py), in two kernels.

Decode (one query per sequence), split-KV: a program per (sequence, query head, split) walks its
split's share of the sequence's blocks with an online softmax and writes a partial (running max,
sum of exponentials, weighted values); a second kernel merges a sequence's splits. Long contexts
are cut into more splits so that a small batch still fills the device (flash-decoding).

Prefill over paged KV (chunked prefill and prefix-cache hits): a program per (chunk, query head,
block of BLOCK_M query rows) reads the chunk's keys and values through its block table -- earlier
chunks' and this step's alike, since the step's keys are stored before attention runs -- with the
causal mask at the chunk's offset (query i of a chunk that ends a context of C tokens sits at
position C - len + i), online softmax, tl.dot on [BLOCK_M, D] x [D, block_size] tiles.

GQA: query head h reads KV head h // (heads / kv_heads). Scores, softmax and accumulation are in
float32; the output is rounded to the activation dtype once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.layers.gpu_kernels import dot_f32


@triton.jit
def _decode_partial_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           m_ptr, l_ptr, acc_ptr, scale, q_seq_stride, q_head_stride, table_stride,
                           cache_head_stride, num_heads, num_splits, blocks_per_split, group_size,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // group_size
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK_SIZE)
    context_len = tl.load(context_lens_ptr + seq)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    q = tl.load(q_ptr + seq * q_seq_stride + head * q_head_stride + dims).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for b in range(first, last):
        block = tl.load(block_tables_ptr + seq * table_stride + b).to(tl.int64)
        rows = kv_head * cache_head_stride + (block * BLOCK_SIZE + offsets)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + rows).to(tl.float32)  # [BLOCK_SIZE, D]
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
        scores = tl.where(b * BLOCK_SIZE + offsets < context_len, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_cache_ptr + rows).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    part = (seq * num_heads + head) * num_splits + split
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, l)
    tl.store(acc_ptr + part * HEAD_DIM + dims, acc)


@triton.jit
def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_heads, num_splits,
                         SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    valid = splits < num_splits
    base = (seq * num_heads + head) * num_splits
    m = tl.load(m_ptr + base + splits, mask=valid, other=-float("inf"))
    l = tl.load(l_ptr + base + splits, mask=valid, other=0.0)
    m_max = tl.max(m, axis=0)  # split 0 always holds a token: finite
    weights = tl.where(valid & (l > 0), tl.exp(m - m_max), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.sum(l * weights, axis=0)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, max_context_len: int,
                     blocks_per_split: int = 32) -> torch.Tensor:
    """q [B, H, D] (unit stride inside a head); caches [KV, num_blocks, block_size, D];
    block_tables [B, max_blocks] int32; context_lens [B] int32 -> [B, H, D]. `max_context_len`
    (known to the host that built the tables) sets the number of splits of `blocks_per_split`
    blocks each."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    num_splits = max(1, triton.cdiv(triton.cdiv(max_context_len, block_size), blocks_per_split))
    partial = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    m, l = partial, torch.empty_like(partial)
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _decode_partial_kernel[(num_seqs, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, l, acc, scale, q.stride(0), q.stride(1),
        block_tables.stride(0), num_blocks * block_size * head_dim, num_heads, num_splits, blocks_per_split,
        num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    _decode_merge_kernel[(num_seqs, num_heads)](m, l, acc, out, num_heads, num_splits,
                                                SPLITS=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, chunk_starts_ptr, chunk_lens_ptr,
                    context_lens_ptr, block_tables_ptr, scale, q_token_stride, q_head_stride, table_stride,
                    cache_head_stride, num_heads, group_size,
                    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr):
    chunk, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunk_len = tl.load(chunk_lens_ptr + chunk)
    if m_block * BLOCK_M >= chunk_len:
        return
    token_start = tl.load(chunk_starts_ptr + chunk)
    context_len = tl.load(context_lens_ptr + chunk)
    kv_head = head // group_size
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < chunk_len
    q_pos = context_len - chunk_len + rows  # absolute position of each query
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (token_start + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last_pos = tl.minimum(context_len - chunk_len + m_block * BLOCK_M + BLOCK_M, context_len)  # keys < this
    for b in range(0, tl.cdiv(last_pos, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + chunk * table_stride + b).to(tl.int64)
        kv_rows = kv_head * cache_head_stride + (block * BLOCK_SIZE + offsets)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_rows)  # [BLOCK_SIZE, D]
        if DOT_F32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_M, BLOCK_SIZE]
        k_pos = b * BLOCK_SIZE + offsets
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < context_len)
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # key 0 is visible to every row: finite
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(v_cache_ptr + kv_rows)
        if DOT_F32:
            v = v.to(tl.float32)
        # the probabilities rounded to the activation dtype, as the reference's SDPA feeds PV
        p_dot = p.to(v_cache_ptr.dtype.element_ty)
        if DOT_F32:
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + (token_start + rows)[:, None] * num_heads * HEAD_DIM + head * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      chunk_starts: torch.Tensor, chunk_lens: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, max_chunk_len: int, block_m: int = 16) -> None:
    """Write each prefill chunk's attention output into its rows of `out` [T, H, D] (contiguous).
    q [T, H, D]; per chunk c: its first token row chunk_starts[c], chunk_lens[c] tokens ending a
    context of context_lens[c], block_tables[c] its blocks (int32 each)."""
    num_chunks = chunk_starts.shape[0]
    if num_chunks == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    grid = (num_chunks, num_heads, triton.cdiv(max_chunk_len, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, out, chunk_starts, chunk_lens, context_lens, block_tables, scale,
                          q.stride(0), q.stride(1), block_tables.stride(0), num_blocks * block_size * head_dim,
                          num_heads, num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_SIZE=block_size,
                          HEAD_DIM=head_dim, DOT_F32=dot_f32(q.dtype))
