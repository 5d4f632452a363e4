"""Paged attention against a dense causal reference, for decode batches and chunked prefill."""
import torch
import torch.nn.functional as F

from shardserve.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk, gather_ids, paged_attention, split_by_length


def reference(q, k, v, scale):
    # q: [T, H, D], k/v: [T, KV, D], causal over the whole sequence
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


def test_decode_and_chunked_prefill_match_dense_attention():
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 32
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, dim)
    lengths = [7, 13]
    seqs = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in lengths]
    tables = [[5, 2, 9, 30], [1, 3, 4, 11]]
    scale = dim**-0.5

    def slots(table, positions):
        return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])

    # step 1: seq 0 prefills tokens 0..5 whole; seq 1 prefills 0..7
    meta = AttentionMetadata(slot_mapping=torch.cat([slots(tables[0], range(6)), slots(tables[1], range(8))]))
    meta.prefills = [PrefillChunk(0, 6, 6, None), PrefillChunk(6, 14, 8, None)]
    q = torch.cat([seqs[0][0][:6], seqs[1][0][:8]])
    k = torch.cat([seqs[0][1][:6], seqs[1][1][:8]])
    v = torch.cat([seqs[0][2][:6], seqs[1][2][:8]])
    out = paged_attention(q, k, v, cache[0], cache[1], meta, scale)
    torch.testing.assert_close(out[:6], reference(*[t[:6] for t in seqs[0]], scale))
    torch.testing.assert_close(out[6:], reference(*[t[:8] for t in seqs[1]], scale))

    # step 2: seq 0 decodes token 6 (batched decode path); seq 1 prefills chunk 8..12 over cached context
    meta = AttentionMetadata(slot_mapping=torch.cat([slots(tables[0], [6]), slots(tables[1], range(8, 13))]))
    max_blocks = 2
    visible = torch.arange(max_blocks * block_size) < 7
    bias = torch.zeros(max_blocks * block_size).masked_fill(~visible, float("-inf")).view(1, 1, -1).repeat(kv_heads, 1, 1)
    meta.decode_groups = [DecodeGroup(0, 1, gather_ids(torch.tensor(tables[0][:max_blocks]), kv_heads, num_blocks), bias)]
    meta.prefills = [PrefillChunk(1, 6, 13, gather_ids(torch.tensor(tables[1]), kv_heads, num_blocks))]
    q = torch.cat([seqs[0][0][6:7], seqs[1][0][8:13]])
    k = torch.cat([seqs[0][1][6:7], seqs[1][1][8:13]])
    v = torch.cat([seqs[0][2][6:7], seqs[1][2][8:13]])
    out = paged_attention(q, k, v, cache[0], cache[1], meta, scale)
    torch.testing.assert_close(out[:1], reference(*seqs[0], scale)[6:7])
    torch.testing.assert_close(out[1:], reference(*seqs[1], scale)[8:13])


def test_pure_decode_batch_with_padding_matches_dense_attention():
    torch.manual_seed(1)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 8, 4, 16
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, dim)
    lengths, tables = [5, 11], [[3, 7], [0, 9, 12]]
    seqs = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in lengths]
    scale = dim**-0.5
    for (q, k, v), table, n in zip(seqs, tables, lengths):  # prefill all but the last token
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n - 1)])
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, n - 1, n - 1, None)])
        paged_attention(q[: n - 1], k[: n - 1], v[: n - 1], cache[0], cache[1], meta, scale)
    max_blocks = 3
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    visible = torch.arange(max_blocks * block_size).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).unsqueeze(1).repeat(kv_heads, 1, 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lengths)]),
        decode_groups=[DecodeGroup(0, 2, gather_ids(torch.tensor(padded).view(-1), kv_heads, num_blocks), bias)])
    q = torch.cat([s[0][-1:] for s in seqs])
    k = torch.cat([s[1][-1:] for s in seqs])
    v = torch.cat([s[2][-1:] for s in seqs])
    out = paged_attention(q, k, v, cache[0], cache[1], meta, scale)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i : i + 1], reference(*s, scale)[-1:])


def test_split_by_length_bounds_padding_and_group_count():
    assert split_by_length([4, 4, 4]) == [(0, 3)]
    assert split_by_length([40, 39, 10, 9, 9, 2]) == [(0, 2), (2, 5), (5, 6)]
    assert len(split_by_length(list(range(100, 0, -1)), max_groups=4)) == 4
    assert split_by_length([]) == []
