"""fp8 and int8 weights: the quantization's error bound, the kernels against the same math done by
hand, and engines with --quantization fp8 / int8 against the unquantized one."""
from __future__ import annotations

import pytest
import torch

from shardserve.config import ConfigError, EngineConfig
from shardserve.layers.linear import Linear
from shardserve.layers.cpu_kernels import load_int8_linear
from shardserve.layers.quantization import (FP8_MAX, Fp8Weight, Int8Weight, int8_linear_reference, quantize_blocks,
                                            quantize_rows)
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


@pytest.mark.parametrize("method,weight_class,bound", [("fp8", Fp8Weight, 0.05), ("int8", Int8Weight, 0.03)])
def test_a_quantized_engine_quantizes_the_layers_but_not_the_head_and_stays_near_the_bf16_one(
        tmp_path, method, weight_class, bound):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama", well_conditioned=True)
    kwargs = dict(dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False)
    plain, quantized = LLM(str(path), **kwargs), LLM(str(path), quantization=method, **kwargs)
    model = quantized.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, weight_class) for m in linears)
    assert not isinstance(model.lm_head.packed, weight_class)
    ids = list(range(3, 40))
    logits = {}
    for chunk in (10**6, 1):  # a whole prefill, then token by token
        logits[chunk] = engine_logits(quantized.engine, ids, chunk)
        assert relative_error(logits[chunk].float(), engine_logits(plain.engine, ids, chunk).float()) < bound, chunk
    if method == "int8":  # a token's logits: the same in a prefill and in a decode step
        assert torch.equal(logits[10**6], logits[1])


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match="unknown quantization 'int3'; choose one of fp8, int8"):
        EngineConfig(quantization="int3")


# --- int8 (Q8_0 blocks) -------------------------------------------------------------------------
def test_int8_blocks_round_within_half_a_step_and_give_back_a_q8_0_tensor_exactly():
    torch.manual_seed(2)
    x = torch.randn(5, 70) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 7.0])[:, None]  # a zero row; 70 = 2 blocks + 6
    q, scale = quantize_blocks(x)
    assert q.shape == (5, 96) and scale.shape == (5, 3) and torch.all(q[:, 70:] == 0) and torch.all(scale[3] == 0)
    step = scale.repeat_interleave(32, dim=1)[:, :70]
    assert torch.all((q[:, :70].float() * step - x).abs() <= step / 2 + 1e-7 * x.abs())
    # llama.cpp's own Q8_0 of a weight, dequantized to float32 as the GGUF loader does, quantizes
    # back to the file's blocks: the same int8 values and the same (float16) scales
    import gguf
    import numpy as np
    w = (torch.randn(8, 64) * 0.1).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)  # [8, 2 blocks x 34 bytes]
    blocks = raw.reshape(8, 2, 34)
    file_scales = blocks[..., :2].copy().view(np.float16).astype(np.float32).reshape(8, 2)
    file_q = blocks[..., 2:].copy().view(np.int8).reshape(8, 64)
    q, scale = quantize_blocks(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)))
    assert torch.equal(q, torch.from_numpy(file_q)) and torch.equal(scale, torch.from_numpy(file_scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_is_the_block_arithmetic_and_the_same_in_any_batch(dtype):
    if load_int8_linear() is None:
        pytest.skip("no native toolchain")
    torch.manual_seed(3)
    for out_features, in_features in ((48, 70), (96, 576)):  # a ragged last block; two blocks a dot
        weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
        int8 = Int8Weight(weight)
        x = torch.randn(37, in_features).to(dtype)  # 9 tiles of 4 rows and one of 1
        y = int8.linear(x, bias)
        expected = int8_linear_reference(x, *int8.blocks())[:, :out_features] + bias.double()
        assert y.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(y.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
        alone = torch.cat([int8.linear(x[i:i + 1], bias) for i in range(len(x))])
        assert torch.equal(y, alone)
        assert relative_error(int8.linear(x.float(), None), x.float() @ weight.t()) < 0.02
