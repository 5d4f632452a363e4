"""The CPU attention backend: native kernels (csrc/) where they pay, the reference path elsewhere.

    rotary + KV store   one native op rotates queries and keys and stores keys and values
                        (csrc/fused_elementwise.cpp; rounds as apply_rotary + write_kv do)
    decodes             one native call for the whole batch, reading keys and values in place
                        from the block pool: no gather, no padding (csrc/paged_decode_attention.cpp)
    prefill chunks      with AVX-512 or AVX2, one native call for every chunk, keys and values
                        read in place as the decodes' are (csrc/paged_prefill_attention.cpp: with
                        AVX-512 1.6-2.4x SDPA's speed at 128-1,024 tokens); elsewhere the
                        reference path's SDPA

Both native kernels run one arithmetic per query row (csrc/attention_rows.h with AVX-512,
csrc/attention_avx2.h with AVX2 only): a token's output has the same bits whether a decode step or
a prefill (a resumed request, a prefix-cache hit, a later chunk) computed it. Where SDPA prefills,
it does not, and quantized linears (GGUF blocks quantize their inputs to 8 bits) turn that last-bit
difference into different tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from shardserve.layers.attention.paged_kv import PagedCache, SeqSpan, padded_block_tables, slot_mapping, write_kv
from shardserve.layers.attention.torch_backend import PrefillChunk, attend_prefills, prefill_chunks
from shardserve.layers.cpu_kernels import load_paged_decode_attention, load_paged_prefill_attention, load_rotary_kv
from shardserve.layers.rotary import apply_rotary


@dataclass
class PrefillTables:
    """The native prefill kernel's view of a step's chunks, one row each, and the kernel itself
    (looked up once per step, not once per layer)."""

    kernel: Callable
    block_table: torch.Tensor  # [chunks, max_blocks] int64 (padded with block 0)
    query_starts: torch.Tensor  # [chunks] int64: the chunk's first row in the packed batch
    query_lens: torch.Tensor  # [chunks] int64
    context_lens: torch.Tensor  # [chunks] int64: the chunk's tokens and all before it


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    num_decodes: int
    block_table: torch.Tensor | None  # [num_decodes, max_blocks] int64 (padded with block 0)
    context_lens: torch.Tensor | None  # [num_decodes] int64
    prefill_tables: PrefillTables | None = None  # the native prefill kernel's; or
    prefills: list[PrefillChunk] = field(default_factory=list)  # the reference path's


class CpuNativeAttention:
    name = "cpu_native"

    def __init__(self, deterministic: bool = True):
        # AMX tiles for prefill attention only when results may differ from the decode kernel's
        self.prefill_tiles = not deterministic
        decode_kernel = load_paged_decode_attention()
        if decode_kernel is None:
            raise RuntimeError("the native CPU attention kernel is not available (no toolchain, or disabled)")
        rotary_kv = load_rotary_kv()
        # the overloads themselves: no lookup on each of the step's per-layer calls
        self.decode_kernel = decode_kernel.default
        self.rotary_kv = None if rotary_kv is None else rotary_kv.default  # None: rotate and store with torch ops

    @staticmethod
    def available() -> bool:
        return load_paged_decode_attention() is not None

    def build_metadata(self, spans: list[SeqSpan], num_decodes: int, cache: PagedCache) -> CpuAttentionMetadata:
        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=cache.device)

        table = lens = None
        if num_decodes:
            tables, context_lens = padded_block_tables(spans[:num_decodes], cache.block_size)
            table, lens = tensor(tables), tensor(context_lens)
        meta = CpuAttentionMetadata(tensor(slot_mapping(spans, cache.block_size)), num_decodes, table, lens)
        chunks = spans[num_decodes:]
        if not chunks:
            return meta
        kernel = load_paged_prefill_attention(cache.dtype, cache.head_dim)
        if kernel is None:
            meta.prefills = prefill_chunks(spans, num_decodes, cache)
            return meta
        tables, context_lens = padded_block_tables(chunks, cache.block_size)
        starts = list(accumulate((s.num_tokens for s in chunks[:-1]), initial=num_decodes))
        meta.prefill_tables = PrefillTables(kernel.default, tensor(tables), tensor(starts), tensor([s.num_tokens for s in chunks]),
                                            tensor(context_lens))
        return meta

    def forward(self, qkv, cos_sin, kv_cache, meta: CpuAttentionMetadata, num_heads: int, scale: float) -> torch.Tensor:
        q, k = self._rotate_and_store(qkv, cos_sin, kv_cache, meta.slot_mapping, num_heads)
        n = meta.num_decodes
        decoded = None
        if n:
            decoded = self.decode_kernel(q if n == q.shape[0] else q[:n].contiguous(), kv_cache[0], kv_cache[1],
                                         meta.block_table, meta.context_lens, scale)
            if not meta.prefills and meta.prefill_tables is None:
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:n] = decoded
        if meta.prefill_tables is not None:
            tables = meta.prefill_tables
            tables.kernel(q.contiguous(), kv_cache[0], kv_cache[1], tables.block_table, tables.query_starts,
                   tables.query_lens, tables.context_lens, scale, out, self.prefill_tiles)
        else:
            v = qkv[:, num_heads + k.shape[1] :]
            attend_prefills(out, q, k, v, kv_cache, meta.prefills, scale)
        return out

    def _rotate_and_store(self, qkv, cos_sin, kv_cache, slots, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries [T, H, D], rotated keys [T, KV, D]); keys and values stored at `slots`."""
        if self.rotary_kv is not None and qkv.is_contiguous():
            return self.rotary_kv(qkv, *cos_sin, kv_cache[0], kv_cache[1], slots, num_heads)
        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], cos_sin)
        write_kv(kv_cache[0], kv_cache[1], qk[:, num_heads:], qkv[:, num_heads + num_kv_heads :], slots)
        return qk[:, :num_heads], qk[:, num_heads:]
