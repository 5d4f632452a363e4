"""RMSNorm with the folded residual add: native CPU op against the torch formula."""
import pytest
import torch

from shardserve.layers.cpu_kernels import load_add_rms_norm
from shardserve.layers.norm import RMSNorm


def reference(x, delta, weight, eps):
    y = x + delta if delta is not None else x.clone()
    y32 = y.float()
    return y, weight * (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_adds_residual_in_place_and_normalizes(dtype, tol, with_delta):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data.normal_()
    x, delta = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype) if with_delta else None
    want_x, want = reference(x, delta, norm.weight, 1e-5)
    got = norm(x, delta)
    assert torch.equal(x, want_x)  # the residual stream now holds x + delta
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_native_op_is_used_on_cpu_when_available():
    assert (RMSNorm(8, 1e-6, torch.float32).fused is not None) == (load_add_rms_norm() is not None)
