"""Every attention backend against a dense causal reference, for decode batches and chunked
prefill over the paged cache, driven through the one backend interface."""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from shardserve.layers.attention.backend import attention_backend
from shardserve.layers.attention.cpu_backend import CpuNativeAttention
from shardserve.layers.attention.paged_kv import SeqSpan
from shardserve.layers.attention.torch_backend import split_by_length
from shardserve.layers.attention.triton_backend import TritonAttention
from shardserve.layers.cpu_kernels import load_paged_prefill_attention

BACKENDS = ["torch", pytest.param("cpu_native", marks=pytest.mark.skipif(
    not CpuNativeAttention.available(), reason="no C++ toolchain for the native kernels")),
    pytest.param("triton", marks=pytest.mark.skipif(not TritonAttention.available(), reason="triton not installed"))]


@dataclass
class Cache:
    """The geometry a backend reads (engine/kv_cache.py's KVCache has the same fields)."""

    tensor: torch.Tensor  # [2, KV, num_blocks, block_size, D]

    num_blocks = property(lambda self: self.tensor.shape[2])
    block_size = property(lambda self: self.tensor.shape[3])
    num_kv_heads = property(lambda self: self.tensor.shape[1])
    head_dim = property(lambda self: self.tensor.shape[-1])
    dtype = property(lambda self: self.tensor.dtype)
    device = property(lambda self: self.tensor.device)


def reference(q, k, v, scale):
    # q: [T, H, D], k/v: [T, KV, D], causal over the whole sequence
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


def run(backend, cache: Cache, spans: list[SeqSpan], num_decodes: int, q, k, v, scale):
    """One step through the interface; rotary is the identity (cos 1, sin 0), so q and k pass as they are."""
    meta = backend.build_metadata(spans, num_decodes, cache)
    qkv = torch.cat([q, k, v], dim=1).contiguous()
    cos_sin = (torch.ones(q.shape[0], 1, q.shape[-1], dtype=q.dtype), torch.zeros(q.shape[0], 1, q.shape[-1], dtype=q.dtype))
    return backend.forward(qkv, cos_sin, cache.tensor, meta, q.shape[1], scale)


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_and_chunked_prefill_match_dense_attention(name):
    torch.manual_seed(0)
    backend = attention_backend(torch.device("cpu"), name)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 32
    cache = Cache(torch.zeros(2, kv_heads, num_blocks, block_size, dim))
    lengths = [7, 13]
    seqs = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in lengths]
    tables = [[5, 2, 9, 30], [1, 3, 4, 11]]
    scale = dim**-0.5

    # step 1: seq 0 prefills tokens 0..5 whole; seq 1 prefills 0..7
    spans = [SeqSpan(0, 6, tables[0]), SeqSpan(0, 8, tables[1])]
    q, k, v = (torch.cat([seqs[0][i][:6], seqs[1][i][:8]]) for i in range(3))
    out = run(backend, cache, spans, 0, q, k, v, scale)
    torch.testing.assert_close(out[:6], reference(*[t[:6] for t in seqs[0]], scale))
    torch.testing.assert_close(out[6:], reference(*[t[:8] for t in seqs[1]], scale))

    # step 2: seq 0 decodes token 6 (batched decode path); seq 1 prefills chunk 8..12 over cached context
    spans = [SeqSpan(6, 1, tables[0]), SeqSpan(8, 5, tables[1])]
    q, k, v = (torch.cat([seqs[0][i][6:7], seqs[1][i][8:13]]) for i in range(3))
    out = run(backend, cache, spans, 1, q, k, v, scale)
    torch.testing.assert_close(out[:1], reference(*seqs[0], scale)[6:7])
    torch.testing.assert_close(out[1:], reference(*seqs[1], scale)[8:13])


@pytest.mark.parametrize("name", BACKENDS)
def test_pure_decode_batch_with_padding_matches_dense_attention(name):
    torch.manual_seed(1)
    backend = attention_backend(torch.device("cpu"), name)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 8, 4, 16
    cache = Cache(torch.zeros(2, kv_heads, num_blocks, block_size, dim))
    lengths, tables = [11, 5], [[0, 9, 12], [3, 7]]  # packed longest first, as the runner packs decodes
    seqs = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in lengths]
    scale = dim**-0.5
    for (q, k, v), table, n in zip(seqs, tables, lengths):  # prefill all but the last token
        run(backend, cache, [SeqSpan(0, n - 1, table)], 0, q[: n - 1], k[: n - 1], v[: n - 1], scale)
    spans = [SeqSpan(n - 1, 1, table) for table, n in zip(tables, lengths)]
    q, k, v = (torch.cat([s[i][-1:] for s in seqs]) for i in range(3))
    out = run(backend, cache, spans, 2, q, k, v, scale)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i : i + 1], reference(*s, scale)[-1:])


@pytest.mark.skipif(not CpuNativeAttention.available(), reason="no C++ toolchain for the native kernels")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (16, 2, 128)])  # bf16 with AMX: 1 and 4 tile steps
def test_native_decode_matches_torch_path(dtype, tol, heads, kv_heads, dim):
    torch.manual_seed(0)
    block_size, num_blocks, batch = 16, 64, 5
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, dtype=dtype)
    lens = [64, 40, 33, 17, 1]
    tables = torch.randperm(num_blocks)[: batch * 4].view(batch, 4).tolist()
    spans = [SeqSpan(n - 1, 1, table) for n, table in zip(lens, tables)]
    q, k, v = (torch.randn(batch, n, dim, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    outs = [run(attention_backend(torch.device("cpu"), name), Cache(cache.clone()), spans, batch, q, k, v, dim**-0.5)
            for name in ("torch", "cpu_native")]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


def _native_prefill(dtype, dim):
    return pytest.mark.skipif(load_paged_prefill_attention(dtype, dim) is None,
                              reason="the native prefill kernel needs AVX-512 or AVX2 and a C++ toolchain")


@pytest.mark.parametrize("dtype, tol, dim", [
    pytest.param(torch.float32, 1e-5, 64, marks=_native_prefill(torch.float32, 64)),
    pytest.param(torch.bfloat16, 2e-2, 64, marks=_native_prefill(torch.bfloat16, 64)),
    pytest.param(torch.bfloat16, 2e-2, 128, marks=_native_prefill(torch.bfloat16, 128))])
def test_native_prefill_matches_torch_path(dtype, tol, dim):
    """A decode, a chunk over a cached prefix that spans key blocks and a whole prompt, in one step."""
    torch.manual_seed(0)
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, dtype=dtype)
    tables = torch.randperm(num_blocks)[:3 * 8].view(3, 8).tolist()
    spans = [SeqSpan(40, 1, tables[0]), SeqSpan(29, 70, tables[1]), SeqSpan(0, 45, tables[2])]
    tokens = sum(s.num_tokens for s in spans)
    q, k, v = (torch.randn(tokens, n, dim, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    outs = [run(attention_backend(torch.device("cpu"), name), Cache(cache.clone()), spans, 1, q, k, v, dim**-0.5)
            for name in ("torch", "cpu_native")]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


@_native_prefill(torch.bfloat16, 64)
def test_native_prefill_rows_do_not_depend_on_chunking_or_batch():
    """A prompt prefilled whole, alone, and in three chunks beside another prompt: the same bits."""
    torch.manual_seed(0)
    backend = attention_backend(torch.device("cpu"), "cpu_native")
    heads, kv_heads, dim, block_size, num_blocks, n = 9, 3, 64, 16, 32, 100
    q, k, v = (torch.randn(n, h, dim, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    table = list(range(7))
    whole = run(backend, Cache(torch.zeros(2, kv_heads, num_blocks, block_size, dim, dtype=torch.bfloat16)),
                [SeqSpan(0, n, table)], 0, q, k, v, dim**-0.5)
    cache = Cache(torch.zeros(2, kv_heads, num_blocks, block_size, dim, dtype=torch.bfloat16))
    other = [torch.randn(20, h, dim, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads)]
    pieces = []
    for start, end in ((0, 33), (33, 64), (64, n)):
        spans = [SeqSpan(0, 20, list(range(20, 22))), SeqSpan(start, end - start, table)] if start == 0 \
            else [SeqSpan(start, end - start, table)]
        parts = [torch.cat([o, t[start:end]]) for o, t in zip(other, (q, k, v))] if start == 0 \
            else [t[start:end] for t in (q, k, v)]
        out = run(backend, cache, spans, 0, *parts, dim**-0.5)
        pieces.append(out[20:] if start == 0 else out)
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("dtype, heads, kv_heads, dim", [
    pytest.param(torch.bfloat16, 9, 3, 64, marks=_native_prefill(torch.bfloat16, 64)),
    pytest.param(torch.float32, 9, 3, 64, marks=_native_prefill(torch.float32, 64)),
    pytest.param(torch.bfloat16, 16, 2, 128, marks=_native_prefill(torch.bfloat16, 128)),
    pytest.param(torch.bfloat16, 4, 4, 80, marks=_native_prefill(torch.bfloat16, 80))])
def test_native_decode_gives_the_bits_of_a_prefill(dtype, heads, kv_heads, dim):
    """What exact resume needs: each token decoded one step at a time (in a batch of other
    decodes, or beside a prefill chunk) has the bits of the same token computed by one prefill
    over the whole sequence, and by a prefill after a cached prefix."""
    torch.manual_seed(0)
    backend = attention_backend(torch.device("cpu"), "cpu_native")
    block_size, num_blocks, n, prompt = 16, 32, 70, 20
    q, k, v = (torch.randn(n, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    table = list(range(5))
    fresh = lambda: Cache(torch.zeros(2, kv_heads, num_blocks, block_size, dim, dtype=dtype))  # noqa: E731
    whole = run(backend, fresh(), [SeqSpan(0, n, table)], 0, q, k, v, dim**-0.5)
    cache = fresh()
    run(backend, cache, [SeqSpan(0, prompt, table)], 0, q[:prompt], k[:prompt], v[:prompt], dim**-0.5)
    other = [torch.randn(1, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    side = [torch.randn(9, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    decoded = []
    for t in range(prompt, n):  # this sequence, another decode, and every 5th step a prefill chunk
        spans = [SeqSpan(t, 1, table), SeqSpan(t % 40, 1, list(range(10, 13)))]
        parts = [torch.cat([x[t:t + 1], o]) for x, o in zip((q, k, v), other)]
        if t % 5 == 0:
            spans.append(SeqSpan(0, 9, list(range(20, 21))))
            parts = [torch.cat([p, s]) for p, s in zip(parts, side)]
        decoded.append(run(backend, cache, spans, 2, *parts, dim**-0.5)[:1])
    assert torch.equal(torch.cat(decoded), whole[prompt:])
    hit = run(backend, cache, [SeqSpan(40, n - 40, table)], 0, q[40:], k[40:], v[40:], dim**-0.5)
    assert torch.equal(hit, whole[40:])


def test_split_by_length_bounds_padding_and_group_count():
    assert split_by_length([4, 4, 4]) == [(0, 3)]
    assert split_by_length([40, 39, 10, 9, 9, 2]) == [(0, 2), (2, 5), (5, 6)]
    assert len(split_by_length(list(range(100, 0, -1)), max_groups=4)) == 4
    assert split_by_length([]) == []


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend(torch.device("cpu"), "flash")
