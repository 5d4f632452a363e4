"""fp8 and int8 weights: the quantization's error bound, the fp8 kernel against the same math done
by hand (int8's kernel is the GGUF block kernel: tests/layers/test_block_quant.py), and engines
with --quantization fp8 / int8 against the unquantized one."""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from shardserve.config import ConfigError, EngineConfig
from shardserve.layers.block_quant import BlockWeight, kernels_available
from shardserve.layers.linear import Linear, PackedWeight
from shardserve.layers.quantization import FP8_MAX, Fp8Weight, int8_weight, quantize_rows
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


@pytest.mark.parametrize("method,weight_class,bound", [("fp8", Fp8Weight, 0.05), ("int8", BlockWeight, 0.03)])
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


# --- int8 (Q8_0 blocks for the block kernel) ------------------------------------------------------
def test_int8_is_llama_cpp_s_q8_0_of_the_weight_and_a_ragged_layer_stays_float():
    if not kernels_available():
        pytest.skip("no native toolchain")
    torch.manual_seed(2)
    weight = torch.randn(40, 96) * torch.tensor([1e-2, 1.0, 50.0, 0.0] * 10)[:, None]  # zero rows; fp16-normal scales
    int8 = int8_weight(weight)
    assert isinstance(int8, BlockWeight) and int8.qtype == QType.Q8_0
    int8.dtype = torch.float32
    values = int8.rows(torch.arange(40))
    expected = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), QType.Q8_0), QType.Q8_0)
    assert torch.equal(values, torch.from_numpy(expected))  # llama-quantize's blocks, exactly
    # within half a step, plus the fp16 rounding of the stored scale (2^-11 of it, times |q| <= 127)
    step = weight.view(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert torch.all((values - weight).view(40, 3, 32).abs() <= step * (0.5 + 127 * 2**-11) + 1e-7)
    ragged = Linear(70, [8], False, torch.float32)  # 70 inputs: not whole blocks
    ragged.weight.data.normal_()
    ragged.prepack("int8")
    assert isinstance(ragged.packed, PackedWeight)
