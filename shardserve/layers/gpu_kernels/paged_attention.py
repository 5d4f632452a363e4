"""Attention over the paged KV cache (layout: layers/attention/paged_kv.py), in two kernels.

Decode (one query per sequence), split-KV: a program per (sequence, KV head, split) walks its
split's share of the sequence's context, several pages at a time, for every query head of the
KV head's GQA group at once, with an online softmax, and writes a partial per query head
(running max, sum of exponentials, weighted values); a second kernel merges a sequence's splits.
Small batches get more splits, so that they still fill the device (flash-decoding).

Prefill over paged KV (chunked prefill and prefix-cache hits): a program per (chunk, query head,
block of BLOCK_M query rows) reads the chunk's keys and values through its block table -- earlier
chunks' and this step's alike, since the step's keys are stored before attention runs -- with the
causal mask at the chunk's offset (query i of a chunk that ends a context of C tokens sits at
position C - len + i), online softmax, tl.dot on [BLOCK_M, D] x [D, BLOCK_N] tiles.

GQA: query head h reads KV head h // (heads / kv_heads). Scores, softmax and accumulation are in
float32; the output is rounded to the activation dtype once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shardserve.layers.gpu_kernels import dot_f32, dot_precision


@triton.jit
def _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, table_ptr, k_pos, in_range, visible, head_offset, scale,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of keys into the online softmax (m, l, acc) of q's rows [R, D]: the keys at
    positions `k_pos` [N] (those `in_range`), each read from its page through the sequence's block
    table at `table_ptr`, in the KV head at `head_offset` of the caches; `visible` [R, N] masks the
    scores. Returns the updated (m, l, acc)."""
    dims = tl.arange(0, HEAD_DIM)
    block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=0)
    slots = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
    kv_rows = head_offset + slots[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_cache_ptr + kv_rows, mask=in_range[:, None], other=0.0)  # [N, D]
    if DOT_F32:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # [R, N]
    scores = tl.where(visible, scores, -float("inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    v = tl.load(v_cache_ptr + kv_rows, mask=in_range[:, None], other=0.0)
    if DOT_F32:
        v = v.to(tl.float32)
    # the probabilities rounded to the activation dtype, as the reference's SDPA feeds PV
    p_dot = p.to(v_cache_ptr.dtype.element_ty)
    if DOT_F32:
        p_dot = p_dot.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION).to(tl.float32)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_partial_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           m_ptr, l_ptr, acc_ptr, scale, q_seq_stride, q_head_stride, table_stride,
                           cache_head_stride, num_heads, num_splits, group_size,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    members = tl.arange(0, GROUP)  # the query heads that share this KV head (rows past the group: padding)
    member_valid = members < group_size
    heads = kv_head * group_size + members
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :],
                mask=member_valid[:, None], other=0.0)  # [GROUP, D]
    if DOT_F32:
        q = q.to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)
    # this sequence's context in num_splits equal shares of whole tiles: the split count is the
    # launch's, fixed per batch size, so a CUDA graph replays it over any context
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    first = split * split_len
    last = tl.minimum(first + split_len, context_len)
    m = tl.full([GROUP], -float("inf"), dtype=tl.float32)
    l = tl.zeros([GROUP], dtype=tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        in_range = k_pos < last
        # key `start` is in range: every row's running max is finite from the first tile on
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * table_stride,
                                 k_pos, in_range, in_range[None, :], kv_head.to(tl.int64) * cache_head_stride, scale,
                                 BLOCK_SIZE, HEAD_DIM, DOT_F32, DOT_PRECISION)
    part = (seq * num_heads + heads) * num_splits + split  # [GROUP]
    tl.store(m_ptr + part, m, mask=member_valid)
    tl.store(l_ptr + part, l, mask=member_valid)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=member_valid[:, None])


@triton.jit
def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_heads, num_splits,
                         SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    valid = splits < num_splits
    base = (seq * num_heads + head) * num_splits
    m = tl.load(m_ptr + base + splits, mask=valid, other=-float("inf"))
    l = tl.load(l_ptr + base + splits, mask=valid, other=0.0)
    # finite: an empty context (a CUDA graph's padding row) has every m at -inf, and its output is 0
    m_max = tl.maximum(tl.max(m, axis=0), -1e30)
    weights = tl.where(valid & (l > 0), tl.exp(m - m_max), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
    total = tl.sum(l * weights, axis=0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


MAX_SPLITS = 16


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the device twice over (a batch of one at a long
    context still reads its KV cache with every multiprocessor), at most MAX_SPLITS."""
    units = _multiprocessors(device.index) if device.type == "cuda" else 4
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * units, max(1, num_seqs * num_kv_heads))))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                     block_n: int = 64) -> torch.Tensor:
    """q [B, H, D] (unit stride inside a head); caches [KV, num_blocks, block_size, D];
    block_tables [B, max_blocks] int32; context_lens [B] int32 -> [B, H, D]. Each sequence's
    context is cut into `num_splits` shares (default: decode_splits), read `block_n` keys at a time
    by one program per KV head for all the query heads it serves: a GQA group reads its keys and
    values once, as a [group, D] x [D, block_n] product. The split count depends on the batch
    only, never on the contexts: a decode graph replays one launch shape."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_splits = num_splits or decode_splits(num_seqs, num_kv_heads, q.device)
    m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, l, acc, scale, q.stride(0), q.stride(1),
        block_tables.stride(0), num_blocks * block_size * head_dim, num_heads, num_splits, group,
        GROUP=max(16, triton.next_power_of_2(group)), BLOCK_N=max(block_n, block_size), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, DOT_F32=dot_f32(q.dtype), DOT_PRECISION=dot_precision(q.dtype))
    _decode_merge_kernel[(num_seqs, num_heads)](m, l, acc, out, num_heads, num_splits,
                                                SPLITS=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, chunk_starts_ptr, chunk_lens_ptr,
                    context_lens_ptr, block_tables_ptr, scale, q_token_stride, q_head_stride, table_stride,
                    cache_head_stride, num_heads, group_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
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
    q = tl.load(q_ptr + (token_start + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last_pos = tl.minimum(context_len - chunk_len + m_block * BLOCK_M + BLOCK_M, context_len)  # keys < this
    for start in range(0, last_pos, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        in_range = k_pos < last_pos
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_range[None, :]  # key 0 is visible to every row
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + chunk * table_stride,
                                 k_pos, in_range, visible, kv_head.to(tl.int64) * cache_head_stride, scale,
                                 BLOCK_SIZE, HEAD_DIM, DOT_F32, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + (token_start + rows)[:, None] * num_heads * HEAD_DIM + head * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      chunk_starts: torch.Tensor, chunk_lens: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, max_chunk_len: int, block_m: int | None = None,
                      block_n: int | None = None, num_warps: int = 4) -> None:
    """Write each prefill chunk's attention output into its rows of `out` [T, H, D] (contiguous).
    q [T, H, D]; per chunk c: its first token row chunk_starts[c], chunk_lens[c] tokens ending a
    context of context_lens[c], block_tables[c] its blocks (int32 each). A program takes `block_m`
    queries of one head against `block_n` keys at a time (powers of two, block_n a multiple of
    the page size or below it). By default 64 x 64 tiles: on an H200 at a 4k-token prompt (Llama-3-8B
    heads) 212 TFLOP/s against 57 for 16 x 16, within 1% of the best shape measured (128 x 128, 8
    warps), and better for short chunks (benchmarks/results/gpu_check_s21_run2.json); float32 takes
    32 x 32, its tiles twice the bytes."""
    num_chunks = chunk_starts.shape[0]
    if num_chunks == 0:
        return
    default = 64 if q.dtype != torch.float32 else 32
    block_m, block_n = block_m or default, block_n or default
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    grid = (num_chunks, num_heads, triton.cdiv(max_chunk_len, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, out, chunk_starts, chunk_lens, context_lens, block_tables, scale,
                          q.stride(0), q.stride(1), block_tables.stride(0), num_blocks * block_size * head_dim,
                          num_heads, num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DOT_F32=dot_f32(q.dtype),
                          DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps)
