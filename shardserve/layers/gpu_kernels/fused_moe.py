"""The routed experts of an MoE layer as two grouped GEMMs, with no host synchronisation.

The T x k (token, choice) pairs are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (`align_pairs`, torch ops on the device: counts, prefix sums, a scatter), so that every
BLOCK_M rows of the sorted order belong to one expert, named in `block_experts` (-1: padding past
the end). Then

    gate_up [P, 2I] = x[token of pair] @ W_gate_up[expert]^T      (kernel 1, rows gathered)
    act     [P, I]  = silu(gate) * up                              (elementwise.silu_and_mul)
    down    [P, H]  = act[pair] @ W_down[expert]^T * weight[pair]  (kernel 1 again, rows by pair)
    out     [T, H]  = sum over a token's k pairs, in float32       (a reshape and a sum: no atomics,
                                                                    so the result is deterministic)

A pair whose expert is not held here (expert parallelism, or -1) contributes zero.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.layers.gpu_kernels import dot_f32, dot_precision
from shardserve.layers.gpu_kernels.elementwise import silu_and_mul


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr,
                        num_pairs, n_size, k_size, top_k, a_row_stride, w_expert_stride, w_row_stride,
                        ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    m_block, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + m_block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + m_block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if ROWS_ARE_TOKENS:  # the first GEMM reads each pair's token row of x
        a_rows = pairs // top_k
    else:  # the second reads the pair's own row
        a_rows = pairs
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < n_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < k_size
        a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * a_row_stride + ks[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptr + expert * w_expert_stride + cols[None, :] * w_row_stride + ks[:, None],
                    mask=col_valid[None, :] & k_valid[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION).to(tl.float32)
    if MUL_WEIGHT:  # the expert's output rounded as the reference's linear rounds it, then weighted
        weight = tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * n_size + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_valid[None, :])


def align_pairs(expert_of_pair: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_of_pair [P] (-1: not held here) -> (sorted_pairs [capacity]: pair ids grouped by
    expert, each group padded to a multiple of block_m with P; block_experts [capacity / block_m]:
    the expert of each block, -1 past the end). Capacity is P + E (block_m - 1) rounded up, a
    bound known without reading the counts back to the host."""
    num_pairs, device = expert_of_pair.shape[0], expert_of_pair.device
    held = expert_of_pair >= 0
    experts = torch.where(held, expert_of_pair, num_experts)  # absent experts sort last, then dropped
    counts = torch.bincount(experts, minlength=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    group_start = torch.cumsum(padded, 0) - padded  # [E] where each expert's run starts
    order = torch.argsort(experts, stable=True)  # pairs grouped by expert
    sorted_experts = experts[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] in the unpadded order
    keep = sorted_experts < num_experts
    order, sorted_experts = order[keep], sorted_experts[keep]
    rank = torch.arange(order.shape[0], device=device) - first_of_expert[sorted_experts]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[group_start[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    group_end = torch.cumsum(padded, 0)
    block_experts = torch.searchsorted(group_end, block_starts, right=True)  # [num_blocks]
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, slot_of_pair: torch.Tensor,
                  pair_weights: torch.Tensor, top_k: int, block_m: int = 16, block_n: int = 32,
                  block_k: int = 32) -> torch.Tensor:
    """x [T, H]; gate_up [S, 2I, H] and down [S, H, I] (S local slots); slot_of_pair [T*k] the
    slot of each (token, choice) pair, -1 when not held here; pair_weights [T*k] float32 ->
    [T, H] in x's dtype, each token's weighted sum over its held experts (float32 sum)."""
    num_tokens, hidden = x.shape
    num_slots, width2, _ = gate_up.shape
    num_pairs = slot_of_pair.shape[0]
    sorted_pairs, block_experts = align_pairs(slot_of_pair, num_slots, block_m)
    num_blocks = block_experts.shape[0]
    h = torch.zeros((num_pairs, width2), dtype=x.dtype, device=x.device)
    _expert_gemm_kernel[(num_blocks, triton.cdiv(width2, block_n))](
        x, gate_up, h, sorted_pairs, block_experts, pair_weights, num_pairs, width2, hidden, top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), ROWS_ARE_TOKENS=True, MUL_WEIGHT=False,
        DOT_F32=dot_f32(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    act = silu_and_mul(h)  # [P, I]
    out = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _expert_gemm_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, down, out, sorted_pairs, block_experts, pair_weights, num_pairs, hidden, act.shape[1], top_k,
        act.stride(0), down.stride(0), down.stride(1), ROWS_ARE_TOKENS=False, MUL_WEIGHT=True,
        DOT_F32=dot_f32(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
