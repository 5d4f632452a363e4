"""fp8 weights: the quantization's error bound, the scaled matmul against the same math done by
hand, and an engine with --quantization fp8 against the unquantized one."""
from __future__ import annotations

import pytest
import torch

from shardserve.config import ConfigError, EngineConfig
from shardserve.layers.linear import Linear
from shardserve.layers.quantization import FP8_MAX, Fp8Weight, quantize_rows
from shardserve.llm import LLM
from tests.conftest import write_tiny_checkpoint
from tests.engine_helpers import engine_logits, relative_error


def test_each_row_is_scaled_to_the_fp8_range_and_rounded_within_its_precision():
    torch.manual_seed(0)
    x = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 50.0, 1e4, 0.2, 7.0])[:, None]  # rows of any magnitude
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((6,), FP8_MAX))  # each row's largest hits the top
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; the smallest
    # (subnormal) ones by half the format's smallest step, 2^-10, times the row's scale
    err = (q.float() * scale - x).abs()
    assert torch.all(err <= 2**-4 * x.abs() + 2**-10 * scale)


def test_the_scaled_matmul_is_the_product_of_the_dequantized_operands():
    torch.manual_seed(1)
    weight, x, bias = torch.randn(48, 32), torch.randn(5, 32), torch.randn(48)
    fp8 = Fp8Weight(weight)
    xq, x_scale = quantize_rows(x)
    expected = (xq.float() * x_scale) @ fp8.dequantized().t() + bias
    torch.testing.assert_close(fp8.linear(x, bias), expected, atol=1e-4, rtol=1e-4)
    assert relative_error(fp8.linear(x, None), x @ weight.t()) < 0.06  # and near the unquantized product


def test_an_fp8_engine_quantizes_the_layers_but_not_the_head_and_stays_near_the_bf16_one(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", well_conditioned=True)
    kwargs = dict(dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False)
    plain, fp8 = LLM(str(path), **kwargs), LLM(str(path), quantization="fp8", **kwargs)
    model = fp8.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, Fp8Weight) for m in linears)
    assert not isinstance(model.lm_head.packed, Fp8Weight)
    ids = list(range(3, 40))
    for chunk in (10**6, 1):  # a whole prefill, then token by token
        ours, reference = engine_logits(fp8.engine, ids, chunk).float(), engine_logits(plain.engine, ids, chunk).float()
        assert relative_error(ours, reference) < 0.05, chunk


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match="unknown quantization 'int3'; choose one of fp8"):
        EngineConfig(quantization="int3")
