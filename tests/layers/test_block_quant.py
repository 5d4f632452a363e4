"""GGUF blocks kept as they are (`--quantization gguf`): the packed layout against the gguf package's
own blocks, the kernel against the block arithmetic done in float64, and an engine serving a GGUF
in its blocks against the same file dequantized."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from shardserve.config import ConfigError
from shardserve.layers.block_quant import BlockWeight, ConcatBlockWeight, RawBlocks, block_linear_reference
from shardserve.layers.cpu_kernels import load_block_linear
from shardserve.layers.linear import Linear, PackedWeight
from shardserve.llm import LLM
from tests.conftest import write_tiny_checkpoint
from tests.engine_helpers import engine_logits, relative_error
from tests.models.test_gguf_file import write_hf_model_as_gguf

FORMATS = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q6_K]
K_QUANTS = (QType.Q4_K, QType.Q6_K)
needs_kernels = pytest.mark.skipif(load_block_linear() is None, reason="no native toolchain")


def _k_quant(qtype: QType, rows: int, cols: int, scale: float = 0.01) -> torch.Tensor:
    """Random K-quant super-blocks (the gguf package cannot quantize to them): every byte random
    but the fp16 d (and dmin), positive, up to 1.1 `scale`."""
    nbytes, halves_at = {QType.Q4_K: (144, 0), QType.Q6_K: (210, 208)}[qtype]
    blocks = torch.randint(0, 256, (rows, cols // 256, nbytes), dtype=torch.uint8)
    count = 2 if qtype == QType.Q4_K else 1
    halves = ((torch.rand(rows, cols // 256, count) + 0.1) * scale).to(torch.float16)
    blocks[..., halves_at:halves_at + 2 * count] = halves.view(torch.uint8).reshape(rows, cols // 256, 2 * count)
    return blocks.reshape(rows, -1)


def _raw(weight: torch.Tensor, qtype: QType) -> RawBlocks:
    if qtype in K_QUANTS:
        return RawBlocks(qtype, _k_quant(qtype, *weight.shape), weight.shape[1])
    return RawBlocks(qtype, torch.from_numpy(gguf.quants.quantize(weight.numpy(), qtype)), weight.shape[1])


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS)
def test_rows_read_back_from_the_packed_layout_are_llama_cpp_s_values(qtype):
    torch.manual_seed(0)
    raw = _raw(torch.randn(37, 512), qtype)  # 37 rows: a last group of 16 that is mostly padding
    reference = torch.from_numpy(gguf.quants.dequantize(raw.data.numpy(), qtype))
    assert torch.equal(raw.dequantize(), reference)
    weight = BlockWeight(raw)
    weight.dtype = torch.float32
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(weight.rows(ids), reference[ids])  # every byte of every row, through the packing
    size = 256 if qtype in K_QUANTS else 32
    assert raw.narrow_cols(size, size).dequantize().equal(reference[:, size:2 * size])
    assert raw.narrow_cols(size // 2, size) is None  # not on block boundaries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", FORMATS)
@needs_kernels
def test_kernel_is_the_block_arithmetic_and_the_same_in_any_batch(qtype, dtype):
    torch.manual_seed(1)
    shapes = ((40, 256), (96, 768)) if qtype in K_QUANTS else ((40, 64), (96, 576))
    for out_features, in_features in shapes:
        weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
        raw = _raw(weight, qtype)
        blocks = BlockWeight(raw)
        x = torch.randn(11, in_features).to(dtype)  # tiles of 4 rows and one of 3
        y = blocks.linear(x, bias)
        expected = block_linear_reference(x, raw) + bias.double()
        assert y.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(y.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
        wide = blocks.linear_float(x)
        assert wide.dtype == torch.float32
        torch.testing.assert_close(wide.double(), expected - bias.double(), atol=1e-5 * expected.abs().max().item(),
                                   rtol=1e-5)
        alone = torch.cat([blocks.linear(x[i:i + 1], bias) for i in range(len(x))])
        assert torch.equal(y, alone)
        # and near the float product: Q4 keeps 4 bits a weight, the activations 8
        dequantized = raw.dequantize()
        bound = 0.02 if qtype == QType.Q8_0 else 0.15
        assert relative_error(blocks.linear(x.float(), None), x.float() @ dequantized.t()) < 0.02
        if qtype not in K_QUANTS:  # random K-quant blocks stand for no weight in particular
            assert relative_error(blocks.linear(x.float(), None), x.float() @ weight.t()) < bound


@needs_kernels
def test_every_output_row_is_computed_once_whatever_the_thread_count():
    """Threads walk contiguous runs of 64-row chunks and take what is left of each other's runs
    from the back: with more threads than cores some always do. Rows left out would read as the
    uninitialized output; any thread count gives the one-thread bits."""
    torch.manual_seed(2)
    raw = _raw(torch.randn(1000, 64) * 0.1, QType.Q4_1)  # 63 groups of 16 rows: 16 chunks, the last short
    blocks = BlockWeight(raw)
    x = torch.randn(5, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [blocks.linear(x[:n], None) for n in (1, 5)]
        for count in (2, 3, 7):
            torch.set_num_threads(count)
            for _ in range(20):
                assert all(torch.equal(blocks.linear(x[:n], None), y) for n, y in zip((1, 5), expected))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(expected[1].double(), block_linear_reference(x, raw), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_row_parallel_slice_keeps_blocks_only_on_block_boundaries():
    torch.manual_seed(2)
    weight = torch.randn(8, 128)
    tensor = _lazy_blocks(weight, QType.Q8_0)
    aligned = Linear(64, [8], False, torch.float32, input_slice=(64, 64))  # rank 1 of 2
    ragged = Linear(48, [8], False, torch.float32, input_slice=(48, 48))  # a share of 48 cuts a block
    for layer in (aligned, ragged):
        layer.keep_blocks = True
        layer.weight.weight_loader(layer.weight, tensor)
        layer.prepack()
    assert isinstance(aligned.packed, BlockWeight)
    aligned.packed.dtype = torch.float32
    assert torch.equal(aligned.packed.rows(torch.arange(8)), tensor.read()[:, 64:])
    assert isinstance(ragged.packed, PackedWeight)  # dequantized, then packed as a float weight
    x = torch.randn(3, 48)
    torch.testing.assert_close(ragged(x), x @ tensor.read()[:, 48:96].t())


def _lazy_blocks(weight, qtype):
    from shardserve.layers.lazy_tensor import LazyTensor

    raw = _raw(weight, qtype)
    whole = raw.dequantize()
    return LazyTensor(tuple(whole.shape), lambda dim, a, b: whole if dim is None else whole.narrow(dim, a, b - a),
                      lambda: raw)


def _tiny_gguf(tmp_path, qtypes, hidden=64, intermediate=128):
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    state_dict = transformers.LlamaForCausalLM(hf_config).state_dict()
    for name, tensor in state_dict.items():  # a well-conditioned model: small weights, unit norms
        if name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
            tensor.copy_(torch.randn_like(tensor) * 0.1)
    names = [f"blk.{i}.{t}.weight" for i in range(2) for t in
             ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")] + ["token_embd.weight"]
    return write_hf_model_as_gguf(tmp_path / "tiny.gguf", "llama", hf_config, state_dict,
                                  qtypes={n: qtypes(n) for n in names}, quantize=_quantize)


def _quantize(array, qtype):
    """The gguf package's blocks; random ones for the K-quants, which it cannot make (scaled to
    weights of ~0.1, as the other tensors of the tiny model)."""
    if qtype in K_QUANTS:
        return _k_quant(qtype, *array.shape, scale=1e-4).numpy()
    return gguf.quants.quantize(array, qtype)


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS[:3])
def test_an_engine_on_gguf_blocks_stays_near_the_dequantized_file_and_is_batch_invariant(tmp_path, qtype):
    path = _tiny_gguf(tmp_path, lambda name: QType.Q8_0 if name == "token_embd.weight" else qtype)
    kwargs = dict(dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False,
                  skip_tokenizer_init=True)
    plain, blocks = LLM(str(path), quantization="none", **kwargs), LLM(str(path), quantization="gguf", **kwargs)
    model = blocks.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, BlockWeight) and m.packed.qtype == qtype for m in linears)
    assert isinstance(model.lm_head.packed, BlockWeight) and model.embed_tokens.shared is model.lm_head.packed
    # what a step reads per weight, the efficiency metrics' byte count: the file's block sizes
    block_bytes = {t: gguf.GGML_QUANT_SIZES[t][1] / gguf.GGML_QUANT_SIZES[t][0] for t in (qtype, QType.Q8_0)}
    params = {"linears": sum(m.packed.out_features * m.packed.in_features for m in linears), "head": 96 * 64}
    expected = ((params["linears"] * block_bytes[qtype] + params["head"] * block_bytes[QType.Q8_0])
                / sum(params.values()))
    assert blocks.engine.weight_bytes_per_param() == pytest.approx(expected)
    assert plain.engine.weight_bytes_per_param() is None  # kept in --dtype: the planner's own count
    ids = list(range(3, 60))
    logits = {chunk: engine_logits(blocks.engine, ids, chunk) for chunk in (10**6, 1)}
    bound = 0.05 if qtype == QType.Q8_0 else 0.1  # the activations' 8 bits (and bf16's own rounding)
    assert relative_error(logits[1].float(), engine_logits(plain.engine, ids, 1).float()) < bound
    assert torch.equal(logits[10**6], logits[1])  # a token's logits: the same in prefill and decode


@needs_kernels
def test_a_k_quant_engine_as_llama_cpp_s_mixed_files_have_it_stays_near_the_dequantized_file(tmp_path):
    # Q4_K_M's mix: Q6_K for attn_v, ffn_down and the tied embedding, Q4_K for the rest
    six = ("attn_v", "ffn_down", "token_embd")
    path = _tiny_gguf(tmp_path, lambda name: QType.Q6_K if any(s in name for s in six) else QType.Q4_K,
                      hidden=256, intermediate=512)
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False,
                  skip_tokenizer_init=True)
    llm = LLM(str(path), quantization="gguf", **kwargs)
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert [p.qtype for p in layer.self_attn.qkv_proj.packed.parts] == [QType.Q4_K, QType.Q4_K, QType.Q6_K]
    assert layer.mlp.down_proj.packed.qtype == QType.Q6_K and layer.mlp.gate_up_proj.packed.qtype == QType.Q4_K
    assert model.lm_head.packed.qtype == QType.Q6_K and model.embed_tokens.shared is model.lm_head.packed
    ids = list(range(3, 40))
    logits = engine_logits(llm.engine, ids, 100)
    assert torch.equal(logits, engine_logits(llm.engine, ids, 1))
    # the activations' 8 bits (measured 0.011)
    assert relative_error(logits, engine_logits(LLM(str(path), quantization="none", **kwargs).engine, ids, 100)) < 0.05


@needs_kernels
def test_shards_in_different_formats_keep_their_blocks_side_by_side(tmp_path):
    # llama.cpp's mixed files (Q4_K_M keeps attn_v in Q6_K); and a shard stored in float
    path = _tiny_gguf(tmp_path, lambda name: QType.Q8_0 if "attn_v" in name else (None if "ffn_up" in name else QType.Q4_0))
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False,
                  skip_tokenizer_init=True)
    llm = LLM(str(path), quantization="gguf", **kwargs)
    layer = llm.engine.runner.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed
    assert isinstance(qkv, ConcatBlockWeight) and [p.qtype for p in qkv.parts] == [QType.Q4_0, QType.Q4_0, QType.Q8_0]
    assert isinstance(gate_up, PackedWeight)  # ffn_gate's blocks dequantized beside ffn_up's floats
    assert llm.engine.runner.model.flat_layers is not None  # still the flat loop
    ids = list(range(3, 20))
    logits = engine_logits(llm.engine, ids, 100)
    assert torch.equal(logits, engine_logits(llm.engine, ids, 1))
    assert relative_error(logits, engine_logits(LLM(str(path), quantization="none", **kwargs).engine, ids, 100)) < 0.1


def test_gguf_quantization_needs_a_gguf_checkpoint_and_a_cpu(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="--quantization gguf needs a .gguf checkpoint"):
        LLM(str(path), quantization="gguf", kv_cache_memory_bytes=16 << 20, show_progress=False)
    gguf_path = _tiny_gguf(tmp_path, lambda name: QType.Q8_0)
    with pytest.raises(ConfigError, match="--quantization gguf runs on CPU kernels"):
        LLM(str(gguf_path), quantization="gguf", device="meta", kv_cache_memory_bytes=16 << 20, show_progress=False,
            skip_tokenizer_init=True)
