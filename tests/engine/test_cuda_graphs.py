"""Decode graphs' static buffers, padding and refills, on the CPU: DecodeGraphs(capture=False)
runs the forward eagerly over the very buffers a CUDA graph would replay, with the Triton
backend in the interpreter. The capture itself runs in benchmarks/gpu_check.py on a GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shardserve.engine.cuda_graphs import DecodeGraphs, buckets_up_to  # noqa: E402
from shardserve.layers.attention.paged_kv import SeqSpan  # noqa: E402
from shardserve.layers.attention.triton_backend import TritonAttention  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 16, 32


class Cache:
    num_blocks, block_size, num_kv_heads, head_dim = NUM_BLOCKS, BLOCK, KV_HEADS, DIM
    dtype, device = torch.float32, torch.device("cpu")


class AttentionOnly(torch.nn.Module):
    """A one-layer 'model': each token's q, k, v are a function of its id and position, so a
    row's output depends on what the KV cache holds for its sequence and nothing else."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.table = torch.randn(100, HEADS + 2 * KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, positions, kv_layers, meta):
        qkv = self.table[input_ids] * (1 + positions[:, None, None] / 64)
        cos_sin = (torch.ones(len(input_ids), 1, DIM), torch.zeros(len(input_ids), 1, DIM))
        return self.attention.forward(qkv, cos_sin, kv_layers[0], meta, HEADS, DIM**-0.5)


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets_up_to(256)[:5] == [1, 2, 4, 8, 16] and buckets_up_to(256)[-1] == 256
    assert buckets_up_to(20) == [1, 2, 4, 8, 16, 20]


def test_replayed_decodes_match_eager_steps_and_padding_writes_nothing():
    attention = TritonAttention()
    model = AttentionOnly(attention)
    kv = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK, DIM)  # earlier tokens, already cached
    eager_kv, graph_kv = [kv.clone()], [kv.clone()]
    graphs = DecodeGraphs(model, graph_kv, attention, Cache(), max_batch=8, max_model_len=NUM_BLOCKS * BLOCK,
                          capture=False)
    steps = [  # (context length before the new token, its blocks) of each sequence
        [(40, [3, 7, 9]), (17, [1, 2]), (5, [30])],  # 3 rows: padded to 4
        [(41, [3, 7, 9])],  # 1 row, after 3: the stale rows of the last step are not read
        [(6, [30]), (18, [1, 2]), (42, [3, 7, 9]), (0, [12]), (70, [4, 5, 6, 8, 10]), (15, [11])],  # 6 -> 8
    ]
    for step, seqs in enumerate(steps):
        spans = [SeqSpan(start, 1, blocks) for start, blocks in seqs]
        ids = torch.tensor([10 * step + i for i in range(len(spans))])
        positions = torch.tensor([start for start, _ in seqs])
        meta = attention.build_metadata(spans, len(spans), Cache())
        assert graphs.covers(meta, len(spans))
        expected = model(ids, positions, eager_kv, meta)
        got = graphs.run(ids, positions, meta)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(graph_kv[0], eager_kv[0])  # the padding rows stored nothing


def test_only_decode_only_steps_within_the_largest_bucket_are_replayed():
    attention = TritonAttention()
    graphs = DecodeGraphs(AttentionOnly(attention), [torch.zeros(2, KV_HEADS, NUM_BLOCKS, BLOCK, DIM)], attention,
                          Cache(), max_batch=4, max_model_len=64, capture=False)
    decodes = [SeqSpan(3, 1, [0]) for _ in range(5)]
    assert graphs.covers(attention.build_metadata(decodes[:4], 4, Cache()), 4)
    assert not graphs.covers(attention.build_metadata(decodes, 5, Cache()), 5)  # past the largest bucket
    mixed = decodes[:2] + [SeqSpan(0, 7, [1])]
    assert not graphs.covers(attention.build_metadata(mixed, 2, Cache()), 9)  # a prefill chunk in the step
