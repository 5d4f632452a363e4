"""The native CPU kernels against the torch code they replace, on the same paged cache (the decode
attention kernel is tested as a backend, in test_attention.py)."""
import pytest
import torch
import torch.nn.functional as F

from shardserve.layers.attention.paged_kv import write_kv
from shardserve.layers.cpu_kernels import cpu_identity, load_argmax_rows, load_rotary_kv, load_silu_mul
from shardserve.layers.rotary import apply_rotary

rotary_kv = load_rotary_kv()
silu_mul = load_silu_mul()
argmax_rows = load_argmax_rows()


@pytest.mark.skipif(rotary_kv is None, reason="no C++ toolchain for the native kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kv_is_bit_identical_to_apply_rotary_plus_write_kv(dtype):
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    cos, sin = (torch.randn(tokens, 1, dim, dtype=dtype) for _ in range(2))
    slots = torch.randperm(20 * 16)[:tokens]
    k_cache = torch.zeros(kv_heads, 20, 16, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    rotated = apply_rotary(qkv[:, : heads + kv_heads], (cos, sin))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, rotated[:, heads:], qkv[:, heads + kv_heads :], slots)
    q, k = rotary_kv(qkv, cos, sin, k_cache, v_cache, slots, heads)
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k, rotated[:, heads:])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.skipif(rotary_kv is None, reason="no C++ toolchain for the native kernel")
def test_rotary_kv_rounds_denormals_and_nans_as_torch():
    """bf16 rounding by the conversion instruction flushes denormals and keeps NaN payloads: the
    kernel must still give torch's bits for denormals (compared as integers) and NaN where
    torch has NaN (whose payload torch's own kernels do not agree on)."""
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 4, 2, 1, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=torch.bfloat16)
    cos, sin = (torch.randn(tokens, 1, dim, dtype=torch.bfloat16) for _ in range(2))
    qkv[0] *= 1e-20  # products near 1e-39: float32 denormals
    cos[0] *= 1e-19
    sin[0] *= 1e-19
    qkv[1, 0, 3] = float("nan")
    slots = torch.arange(tokens)
    k_cache = torch.zeros(kv_heads, 1, 16, dim, dtype=torch.bfloat16)
    rotated = apply_rotary(qkv[:, : heads + kv_heads], (cos, sin))
    assert (rotated[0].float().abs() < torch.finfo(torch.float32).tiny).any() and rotated[1].isnan().any()
    q, k = rotary_kv(qkv, cos, sin, k_cache, torch.zeros_like(k_cache), slots, heads)
    got, want = torch.cat([q, k], dim=1), rotated
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


@pytest.mark.skipif(silu_mul is None, reason="no C++ toolchain for the native kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_torch_ops(dtype):
    """Rows of 2 x 44: the vector loop (16 or 8 lanes) and its scalar tail; large |x| too
    (e^-|x| underflows)."""
    torch.manual_seed(0)
    gate_up = torch.randn(2, 7, 88, dtype=torch.float32) * 4
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = silu_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    # the exp differs from torch's in float32's last bit at most, which can move a bf16 rounding
    # by one step now and then; everything else is the same arithmetic
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=1e-6)
    if dtype == torch.bfloat16:
        assert (got == expected).float().mean() > 0.98


@pytest.mark.skipif(argmax_rows is None, reason="no C++ toolchain for the native kernel")
def test_argmax_rows_answers_as_torch_argmax():
    """Ties (the first wins), the maximum in the scalar tail, NaN, all -inf, signed zeros."""
    torch.manual_seed(0)
    logits = torch.randn(7, 1003)
    logits[1, [5, 700]] = 50.0
    logits[2, 1001] = 60.0
    logits[3, [9, 400]] = float("nan")
    logits[4] = float("-inf")
    logits[5] = 0.0
    logits[5, 0] = -0.0
    logits[6, 17] = float("inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def _cpuinfo(flags: str, mhz: str) -> str:
    core = f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\ncpu MHz\t\t: {mhz}\nflags\t\t: {flags}\n"
    return core.format(n=0) + "\n" + core.format(n=1).replace(mhz, "1.0")


def test_cpu_identity_keys_the_build_on_the_instruction_set_not_the_clock():
    base = cpu_identity(_cpuinfo("avx512f avx512_bf16", "2100.0"))
    assert cpu_identity(_cpuinfo("avx512f avx512_bf16", "3700.5")) == base
    # a host with AMX must not load the build of one without it, nor the other way round
    assert cpu_identity(_cpuinfo("avx512f avx512_bf16 amx_bf16 amx_tile", "2100.0")) != base
    assert cpu_identity(_cpuinfo("avx512f avx512_bf16", "2100.0").replace("Xeon", "EPYC")) != base
