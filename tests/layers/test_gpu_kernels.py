"""The Triton kernels (layers/gpu_kernels) against the torch reference path, at small shapes.
Without a GPU they run in Triton's interpreter on the CPU (tests/conftest.py sets it): the same
kernels a GPU compiles, checked here in CI."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from shardserve.layers import activation, rotary  # noqa: E402
from shardserve.layers.attention.paged_kv import SeqSpan, write_kv as reference_write_kv  # noqa: E402
from shardserve.layers.attention.torch_backend import TorchAttention  # noqa: E402
from shardserve.layers.attention.triton_backend import TritonAttention  # noqa: E402
from shardserve.layers.experts import Experts, route  # noqa: E402
from shardserve.layers.gpu_kernels import elementwise, fp8_linear, fused_moe, paged_attention  # noqa: E402
from shardserve.layers.norm import RMSNorm  # noqa: E402

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(autouse=True)
def on_the_gpu_when_there_is_one():
    """On a GPU host (benchmarks/gpu_check.py) the same tests run compiled: every tensor they make
    is a CUDA tensor."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(None)


def reference_norm(x, delta, weight, eps):
    norm = RMSNorm(x.shape[1], eps, x.dtype)
    norm.weight.data.copy_(weight)
    norm.fused = None  # the plain torch path
    return norm(x, delta)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_the_reference_and_updates_the_stream(dtype, tol, with_delta):
    torch.manual_seed(0)
    x, delta, weight = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype), torch.randn(48, dtype=dtype)
    expected_x = x.clone()
    expected = reference_norm(expected_x, delta if with_delta else None, weight, 1e-6)
    got = elementwise.add_rms_norm(x, delta if with_delta else None, weight, 1e-6)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # the residual add landed in place (in bfloat16 within one rounding: the interpreter truncates
    # float32 -> bfloat16 where a GPU rounds to nearest)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)


def test_rms_norm_of_each_head_normalizes_every_row_of_a_3d_input():
    # the q/k norm of qk-norm models (Qwen3): [tokens, heads, head_dim], one row per head
    torch.manual_seed(3)
    x, weight = torch.randn(4, 3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    expected = reference_norm(x.reshape(12, 16).clone(), None, weight, 1e-6).reshape(4, 3, 16)
    torch.testing.assert_close(elementwise.add_rms_norm(x, None, weight, 1e-6), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_silu_and_mul_matches_the_reference(dtype, tol):
    torch.manual_seed(1)
    gate_up = torch.randn(7, 2 * 40, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(elementwise.silu_and_mul(gate_up), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rotary_matches_the_reference_on_a_strided_view(dtype, tol):
    torch.manual_seed(2)
    emb = rotary.RotaryEmbedding(16, 64, 10000.0, rotary.RopeScaling(), dtype)
    qkv = torch.randn(6, 4 + 2 * 2, 16, dtype=dtype)
    view = qkv[:, :6]  # queries and keys of the fused projection: a token stride of 8 heads
    cos_sin = emb.lookup(torch.tensor([0, 3, 9, 10, 33, 63]))
    torch.testing.assert_close(elementwise.apply_rotary(view, cos_sin), rotary.apply_rotary(view, cos_sin),
                               atol=tol, rtol=tol)


def test_write_kv_matches_the_reference():
    torch.manual_seed(3)
    qkv = torch.randn(5, 4 + 2 * 2, 8)
    k, v = qkv[:, 4:6], qkv[:, 6:]  # strided views, as the backend passes them
    slots = torch.tensor([17, 3, 40, 41, 0])
    expected_k, expected_v = torch.zeros(2, 6, 8, 8), torch.zeros(2, 6, 8, 8)
    reference_write_kv(expected_k, expected_v, k.contiguous(), v.contiguous(), slots)
    got_k, got_v = torch.zeros(2, 6, 8, 8), torch.zeros(2, 6, 8, 8)
    elementwise.write_kv(got_k, got_v, k, v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


def test_write_kv_leaves_out_the_padding_rows_of_slot_minus_one():
    torch.manual_seed(4)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    expected_k, expected_v = torch.zeros(2, 6, 8, 8), torch.zeros(2, 6, 8, 8)
    reference_write_kv(expected_k, expected_v, k[[0, 2]], v[[0, 2]], torch.tensor([17, 40]))
    got_k, got_v = torch.zeros(2, 6, 8, 8), torch.zeros(2, 6, 8, 8)
    elementwise.write_kv(got_k, got_v, k, v, torch.tensor([17, -1, 40]))
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


class Cache:
    def __init__(self, tensor):
        self.tensor = tensor

    num_blocks = property(lambda self: self.tensor.shape[2])
    block_size = property(lambda self: self.tensor.shape[3])
    num_kv_heads = property(lambda self: self.tensor.shape[1])
    head_dim = property(lambda self: self.tensor.shape[-1])
    dtype = property(lambda self: self.tensor.dtype)
    device = property(lambda self: self.tensor.device)


def _step(backend, cache_tensor, spans, num_decodes, qkv, heads, scale):
    cache = Cache(cache_tensor)
    dim = qkv.shape[-1]
    cos_sin = (torch.ones(qkv.shape[0], 1, dim, dtype=qkv.dtype), torch.zeros(qkv.shape[0], 1, dim, dtype=qkv.dtype))
    return backend.forward(qkv, cos_sin, cache.tensor, backend.build_metadata(spans, num_decodes, cache), heads, scale)


@pytest.mark.parametrize("tiles", [None, (16, 32)], ids=["default", "16x32"])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_a_mixed_step_matches_the_torch_backend(dtype, tol, tiles, monkeypatch):
    """Long decodes cut into several splits, a chunk over a cached prefix and a whole prompt,
    GQA with 3 query heads per KV head, blocks scattered over the pool; prefill tiles of the
    default (64 x 64, float32 32 x 32: past a chunk's end) and a narrower one, keys from two pages."""
    if tiles is not None:
        monkeypatch.setattr(paged_attention, "prefill_attention", functools.partial(
            paged_attention.prefill_attention, block_m=tiles[0], block_n=tiles[1]))
    torch.manual_seed(4)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 16, 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, dtype=dtype)  # earlier tokens, already cached
    perm = torch.randperm(num_blocks).tolist()
    spans = [SeqSpan(150, 1, perm[0:10]), SeqSpan(70, 1, perm[10:15]), SeqSpan(3, 1, perm[15:16]),
             SeqSpan(40, 21, perm[16:20]), SeqSpan(0, 18, perm[20:22])]
    num_tokens = sum(s.num_tokens for s in spans)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    expected_cache, got_cache = cache.clone(), cache.clone()
    expected = _step(TorchAttention(), expected_cache, spans, 3, qkv, heads, dim**-0.5)
    got = _step(TritonAttention(), got_cache, spans, 3, qkv, heads, dim**-0.5)
    assert torch.equal(got_cache, expected_cache)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_decode_splits_merge_to_the_same_answer():
    torch.manual_seed(5)
    cache = torch.randn(2, 1, 32, 16, 32)
    q = torch.randn(3, 2, 32)
    tables = torch.randperm(32)[:30].view(3, 10).to(torch.int32)
    lens = torch.tensor([160, 97, 1], dtype=torch.int32)
    whole = paged_attention.decode_attention(q, cache[0], cache[1], tables, lens, 0.2, num_splits=1)
    split = paged_attention.decode_attention(q, cache[0], cache[1], tables, lens, 0.2, num_splits=5, block_n=16)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_fp8_weight_linear_is_the_product_with_the_dequantized_weight(dtype, tol):
    """Both decode kernels, at one row, a few and the most each takes."""
    from shardserve.layers.quantization import Fp8Weight

    torch.manual_seed(6)
    weight = Fp8Weight(torch.randn(96, 80))  # 80: a K that no tile divides
    for kernel, max_rows in (("dot", fp8_linear.MAX_ROWS), ("gemv", fp8_linear.GEMV_MAX_ROWS)):
        for rows in sorted({1, 3, max_rows}):
            x = torch.randn(rows, 80, dtype=dtype)
            expected = (x.float() @ weight.dequantized().t()).to(dtype)
            got = fp8_linear.fp8_weight_linear(x, weight.data, weight.scale.view(-1), kernel)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_align_pairs_groups_each_expert_in_whole_blocks():
    experts = torch.tensor([2, 0, 2, -1, 1, 2, 0, 2, 2])  # pair -> expert, -1 not held here
    sorted_pairs, block_experts = fused_moe.align_pairs(experts, num_experts=3, block_m=4)
    blocks = sorted_pairs.view(-1, 4)
    assert block_experts.tolist()[:4] == [0, 1, 2, 2] and set(block_experts.tolist()[4:]) <= {-1}
    num_pairs = len(experts)
    for block, expert in zip(blocks.tolist(), block_experts.tolist()):
        real = [p for p in block if p < num_pairs]
        assert all(experts[p] == expert for p in real)
    held = sorted(p for p in sorted_pairs.tolist() if p < num_pairs)
    assert held == [p for p in range(num_pairs) if experts[p] >= 0]


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_fused_experts_match_the_expert_loop(dtype, tol):
    torch.manual_seed(6)
    num_experts, hidden, inter, top_k = 6, 32, 24, 2
    experts = Experts(num_experts, hidden, inter, dtype, local_expert_ids=[4, 0, 1, 5])  # 2 and 3 elsewhere
    experts.gate_up.data.normal_(std=0.2)
    experts.down.data.normal_(std=0.2)
    x = torch.randn(9, hidden, dtype=dtype)
    weights, ids = route(torch.randn(9, num_experts), top_k, normalize=True)
    expected = experts(x, ids, weights)  # the CPU loop
    slots = experts.slot_table(x.device)[ids.flatten()]
    got = fused_moe.fused_experts(x, experts.gate_up, experts.down, slots, weights.flatten(), top_k,
                                  block_m=4, block_n=16, block_k=16)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
