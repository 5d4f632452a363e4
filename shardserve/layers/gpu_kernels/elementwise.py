"""RMSNorm with the residual add folded in, SwiGLU's silu-and-mul, rotary embedding and the
paged-KV write: one row (or one token and head) per program.

Each rounds where the torch reference rounds (layers/norm.py, activation.py, rotary.py): the
residual sum is stored in the activation dtype and read back, the normalized row is rounded
before the weight multiplies it, silu(gate) is rounded before the product. So in bfloat16 the
kernels agree with the reference to the last bit wherever the reference's own float32 math
does, and in float32 to rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, num_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    offsets = row * num_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the stream's dtype and stored back
        x = (x.to(tl.float32) + tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (normed * w).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] contiguous (the residual stream, updated in place by `delta` when given) ->
    normalized [..., H]; each row of H is one program (a per-head q/k norm passes [T, heads, D])."""
    num_cols = x.shape[-1]
    num_rows = x.numel() // num_cols
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(num_rows,)](x, delta if delta is not None else x, weight, out, num_cols, eps,
                                      HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(num_cols))
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 d] laid out [gate | up] -> silu(gate) * up [T, d]."""
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, num_heads,
                   HALF: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, HALF)
    base = x_ptr + token * x_token_stride + head * x_head_stride
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(base + dims).to(tl.float32)
    x2 = tl.load(base + HALF + dims).to(tl.float32)
    # cos/sin rows are [c | c] and [s | s] (the reference concatenates the frequencies twice)
    c = tl.load(cos_ptr + token * 2 * HALF + dims).to(tl.float32)
    s = tl.load(sin_ptr + token * 2 * HALF + dims).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as the reference rounds
    first = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
    second = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    out = out_ptr + (token * num_heads + head) * 2 * HALF
    tl.store(out + dims, first)
    tl.store(out + HALF + dims, second)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] (any token and head strides, unit stride inside a head) -> rotated,
    contiguous [T, heads, D]; cos, sin [T, 1, D] as RotaryEmbedding.lookup gives them."""
    num_tokens, num_heads, head_dim = x.shape
    cos, sin = (t.reshape(num_tokens, head_dim).contiguous() for t in cos_sin)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens, num_heads)](x, cos, sin, out, x.stride(0), x.stride(1), num_heads,
                                                HALF=head_dim // 2)
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_token_stride, v_token_stride,
                     k_head_stride, v_head_stride, cache_head_stride, HEAD_DIM: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    keep = dims < tl.where(slot >= 0, HEAD_DIM, 0)  # slot -1: a padding row of a CUDA graph, not stored
    dst = head.to(tl.int64) * cache_head_stride + slot * HEAD_DIM + dims  # past 2^31 in a large pool
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + token * k_token_stride + head * k_head_stride + dims), mask=keep)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + token * v_token_stride + head * v_head_stride + dims), mask=keep)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new keys/values: k, v [T, KV, D] (any token and head strides, unit stride inside a
    head) into caches [KV, num_blocks, block_size, D] at `slots` [T] (paged_kv.slot_mapping); a
    token whose slot is -1 is left out."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens:
        cache_head_stride = k_cache.shape[1] * k_cache.shape[2] * head_dim
        _write_kv_kernel[(num_tokens, num_kv_heads)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
                                                     k.stride(1), v.stride(1), cache_head_stride, HEAD_DIM=head_dim)
