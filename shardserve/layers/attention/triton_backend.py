"""The GPU attention backend: the Triton kernels of layers/gpu_kernels (rotary, KV write, split-KV
decode attention, chunked prefill over paged KV).

Metadata is built on the host once per step and staged through pinned memory: the slot of each
new token, the decodes' block tables and context lengths, and per prefill chunk its first row,
length, context length and block table. Block tables are padded with block 0 to the step's
longest (the kernels never read past a sequence's context).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shardserve.layers.attention.paged_kv import PagedCache, SeqSpan, slot_mapping


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int
    decode_tables: torch.Tensor  # [B, max_blocks] int32
    decode_context_lens: torch.Tensor  # [B] int32
    chunk_starts: torch.Tensor  # [C] int32 first token row of each prefill chunk
    chunk_lens: torch.Tensor  # [C] int32
    chunk_context_lens: torch.Tensor  # [C] int32
    chunk_tables: torch.Tensor  # [C, max_blocks] int32
    max_chunk_len: int


def _staged(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, through pinned memory when the device is a GPU."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _tables(spans: list[SeqSpan], block_size: int) -> list[list[int]]:
    width = max((-(-s.context_len // block_size) for s in spans), default=0)
    return [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in spans] or [[]]


class TritonAttention:
    name = "triton"

    @staticmethod
    def available() -> bool:
        from shardserve.layers.gpu_kernels import triton_available

        return triton_available()

    def build_metadata(self, spans: list[SeqSpan], num_decodes: int, cache: PagedCache) -> TritonAttentionMetadata:
        device, bs = cache.device, cache.block_size
        decodes, chunks = spans[:num_decodes], spans[num_decodes:]
        starts, start = [], num_decodes
        for chunk in chunks:
            starts.append(start)
            start += chunk.num_tokens
        return TritonAttentionMetadata(
            slot_mapping=_staged(slot_mapping(spans, bs), torch.int64, device),
            num_decodes=num_decodes,
            decode_tables=_staged(_tables(decodes, bs), torch.int32, device),
            decode_context_lens=_staged([s.context_len for s in decodes], torch.int32, device),
            chunk_starts=_staged(starts, torch.int32, device),
            chunk_lens=_staged([c.num_tokens for c in chunks], torch.int32, device),
            chunk_context_lens=_staged([c.context_len for c in chunks], torch.int32, device),
            chunk_tables=_staged(_tables(chunks, bs), torch.int32, device),
            max_chunk_len=max((c.num_tokens for c in chunks), default=0),
        )

    # -- decode steps replayed from CUDA graphs (engine/cuda_graphs.py) ------------------------

    @staticmethod
    def graph_metadata(max_batch: int, max_blocks: int, cache: PagedCache) -> TritonAttentionMetadata:
        """Static decode metadata for up to `max_batch` sequences of up to `max_blocks` blocks,
        which a graph captures once and fill_graph_metadata refills before each replay."""
        device = cache.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)
        return TritonAttentionMetadata(
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device), num_decodes=max_batch,
            decode_tables=zeros(max_batch, max_blocks), decode_context_lens=zeros(max_batch),
            chunk_starts=zeros(0), chunk_lens=zeros(0),
            chunk_context_lens=zeros(0), chunk_tables=zeros(0, 1), max_chunk_len=0)

    @staticmethod
    def graph_batch(static: TritonAttentionMetadata, batch: int) -> TritonAttentionMetadata:
        """The first `batch` rows of the static metadata (views: a refill reaches every batch)."""
        return replace(static, slot_mapping=static.slot_mapping[:batch], num_decodes=batch,
                       decode_tables=static.decode_tables[:batch],
                       decode_context_lens=static.decode_context_lens[:batch])

    @staticmethod
    def fill_graph_metadata(static: TritonAttentionMetadata, meta: TritonAttentionMetadata, batch: int) -> None:
        """Copy a decode step's metadata into the static buffers' first rows; rows up to `batch`
        past it are padding: no KV write (slot -1), an empty context."""
        n, width = meta.num_decodes, meta.decode_tables.shape[1]
        static.slot_mapping[:n].copy_(meta.slot_mapping)
        static.slot_mapping[n:batch].fill_(-1)
        static.decode_tables[:n, :width].copy_(meta.decode_tables)
        static.decode_context_lens[:n].copy_(meta.decode_context_lens)
        static.decode_context_lens[n:batch].zero_()

    def forward(self, qkv, cos_sin, kv_cache, meta: TritonAttentionMetadata, num_heads: int, scale: float):
        from shardserve.layers.gpu_kernels.elementwise import apply_rotary, write_kv
        from shardserve.layers.gpu_kernels.paged_attention import decode_attention, prefill_attention

        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], cos_sin)  # [T, H + KV, D]
        q, k, v = qk[:, :num_heads], qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:]
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = torch.empty((qkv.shape[0], num_heads, qkv.shape[2]), dtype=qkv.dtype, device=qkv.device)
        if meta.num_decodes:
            out[: meta.num_decodes] = decode_attention(
                q[: meta.num_decodes], kv_cache[0], kv_cache[1], meta.decode_tables, meta.decode_context_lens,
                scale)
        prefill_attention(out, q, kv_cache[0], kv_cache[1], meta.chunk_starts, meta.chunk_lens,
                          meta.chunk_context_lens, meta.chunk_tables, scale, meta.max_chunk_len)
        return out
