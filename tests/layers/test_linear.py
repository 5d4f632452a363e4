"""Prepacked linear weights (our bf16 kernel, oneDNN's layout) against a float64 matmul."""
import pytest
import torch

from shardserve.layers.cpu_kernels import load_bf16_linear
from shardserve.layers.linear import Linear, prepack_weight

bf16_kernel = load_bf16_linear()


def reference(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.skipif(bf16_kernel is None, reason="no C++ toolchain or no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 7), (13, 33, 576), (40, 96, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_rounds_the_exact_product_to_bfloat16(rows, out_features, in_features, with_bias):
    """Tails of every kind: odd K, N not a multiple of the 32-column panel, M not a multiple of
    the 12-row register block."""
    torch.manual_seed(0)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    packed = prepack_weight(weight)
    assert packed.bf16_kernel is not None
    got = packed.linear(x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # float32 sums in another order than float64's: within one bf16 rounding step of the exact value
    torch.testing.assert_close(got.double(), reference(x, weight, bias), rtol=2**-7, atol=1e-2)


@pytest.mark.skipif(bf16_kernel is None, reason="no C++ toolchain or no AVX512-BF16 on this CPU")
def test_bf16_kernel_row_does_not_depend_on_the_batch():
    torch.manual_seed(1)
    weight = torch.randn(70, 64, dtype=torch.bfloat16)
    batch = torch.randn(37, 64, dtype=torch.bfloat16)
    packed = prepack_weight(weight)
    together = packed.linear(batch, None)
    for row in (0, 12, 36):
        assert torch.equal(packed.linear(batch[row : row + 1], None), together[row : row + 1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linear_gives_the_same_result_before_and_after_prepack(dtype, tol):
    torch.manual_seed(2)
    layer = Linear(48, [32, 16], True, dtype)
    weight, bias = torch.randn(48, 48, dtype=dtype), torch.randn(48, dtype=dtype)
    layer.weight.weight_loader(layer.weight, weight[:32], 0)
    layer.weight.weight_loader(layer.weight, weight[32:], 1)
    layer.bias.weight_loader(layer.bias, bias, None)
    x = torch.randn(2, 5, 48, dtype=dtype)  # leading dims kept
    before = layer(x)
    layer.prepack()
    after = layer(x)
    assert after.shape == (2, 5, 48)
    torch.testing.assert_close(after.double(), reference(x, weight, bias), rtol=tol, atol=tol)
    torch.testing.assert_close(before.double(), reference(x, weight, bias), rtol=tol, atol=tol)
