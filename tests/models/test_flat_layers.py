"""The flat layer loop (models/flat_layers.py) against the module path it stands in for: the same
hidden states and the same KV cache, bit for bit, on a step with decodes and prefill chunks; and
its native decode stack against both on a step of decodes only."""
import pytest
import torch

from shardserve.config import CacheConfig, EngineConfig
from shardserve.engine.model_loader import load_model
from shardserve.layers.attention.paged_kv import SeqSpan
from shardserve.layers.block_quant import BlockWeight
from shardserve.layers.cpu_kernels import load_add_rms_norm, load_decode_stack, load_panel_linear
from shardserve.models.flat_layers import DecodeStack
from tests.layers.test_block_quant import QType, _tiny_gguf

pytestmark = pytest.mark.skipif(load_add_rms_norm() is None, reason="needs the native CPU kernels")
# the loop covers weights a native kernel multiplies: bf16 ones only where the panel kernel takes bf16
DTYPES = [pytest.param("bfloat16", marks=pytest.mark.skipif(load_panel_linear(torch.bfloat16) is None,
                                                            reason="no bf16 panel kernel on this CPU")), "float32"]


def load(path, dtype: str, quantization: str | None = None):
    return load_model(EngineConfig(model=str(path), dtype=dtype, max_model_len=256, show_progress=False,
                                   skip_tokenizer_init=True, quantization=quantization,
                                   cache=CacheConfig(kv_cache_memory_bytes=4 << 20)))


def run(loaded, flat, kv: list[torch.Tensor], spans: list[SeqSpan], num_decodes: int, ids, positions) -> torch.Tensor:
    loaded.model.flat_layers = flat
    if flat is not None:
        assert flat.stack is None or not flat.stack.covers(loaded.attention.build_metadata(spans, num_decodes,
                                                                                           loaded.kv_cache), len(ids))
    meta = loaded.attention.build_metadata(spans, num_decodes, loaded.kv_cache)
    with torch.inference_mode():
        return loaded.model(ids, positions, kv, meta)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the qkv bias
@pytest.mark.parametrize("dtype", DTYPES)
def test_flat_loop_matches_module_path_bit_for_bit(tiny_checkpoints, family, dtype):
    loaded = load(tiny_checkpoints[family], dtype)
    flat = loaded.model.flat_layers
    assert flat is not None
    block = loaded.kv_cache.block_size
    # two decodes (contexts 40 and 9) and two prefill chunks (a fresh prompt, a continued one)
    spans = [SeqSpan(39, 1, [0, 1, 2]), SeqSpan(8, 1, [3]), SeqSpan(0, 13, [4]), SeqSpan(block, 7, [5, 6])]
    positions = torch.tensor([39, 8, *range(13), *range(block, block + 7)])
    ids = torch.randint(2, 300, (len(positions),), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(layer.shape, generator=generator).to(layer.dtype) for layer in loaded.kv_cache.layers]
    outs, caches = [], []
    for path in (None, flat):
        kv = [layer.clone() for layer in start]
        outs.append(run(loaded, path, kv, spans, 2, ids, positions))
        caches.append(torch.stack(kv))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], torch.stack(start))  # the step wrote its keys and values


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])  # per-head q/k norm; MoE layers
def test_layers_the_loop_does_not_cover_take_the_module_path(tiny_checkpoints, family):
    assert load(tiny_checkpoints[family], "float32").model.flat_layers is None


def _decodes_three_ways(loaded) -> None:
    """A step of three decodes (contexts 40, 9 and 1): the module path, the flat loop in Python
    and the native stack give the same hidden states and KV cache bit for bit."""
    flat = loaded.model.flat_layers
    assert flat is not None and flat.stack is not None
    spans = [SeqSpan(39, 1, [0, 1, 2]), SeqSpan(8, 1, [3]), SeqSpan(0, 1, [4])]
    meta = loaded.attention.build_metadata(spans, 3, loaded.kv_cache)
    assert flat.stack.covers(meta, 3)
    positions = torch.tensor([39, 8, 0])
    ids = torch.tensor([5, 77, 3])
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(layer.shape, generator=generator).to(layer.dtype) for layer in loaded.kv_cache.layers]
    stack = flat.stack
    outs, caches = [], []
    for path, native in ((None, False), (flat, False), (flat, True)):
        flat.stack = stack if native else None
        loaded.model.flat_layers = path
        kv = [layer.clone() for layer in start]
        with torch.inference_mode():
            outs.append(loaded.model(ids, positions, kv, meta))
        caches.append(torch.stack(kv))
    for out, cache in zip(outs[1:], caches[1:]):
        assert torch.equal(outs[0], out)
        assert torch.equal(caches[0], cache)
    assert not torch.equal(caches[0], torch.stack(start))


needs_stack = pytest.mark.skipif(load_decode_stack() is None, reason="needs the native decode stack")


@needs_stack
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the qkv bias
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_stack_decodes_as_the_flat_loop_and_the_modules_do(tiny_checkpoints, family, dtype):
    _decodes_three_ways(load(tiny_checkpoints[family], dtype))


@needs_stack
def test_the_native_stack_decodes_gguf_blocks_as_the_flat_loop_does(tmp_path):
    path = _tiny_gguf(tmp_path, lambda name: QType.Q4_1 if "ffn" in name else QType.Q8_0)
    loaded = load(path, "bfloat16", "gguf")
    assert all(isinstance(w, BlockWeight) for layer in loaded.model.flat_layers.layers
               for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    _decodes_three_ways(loaded)


@needs_stack
def test_the_stack_stands_aside_for_weights_its_kernels_do_not_take(tiny_checkpoints):
    loaded = load(tiny_checkpoints["llama"], "float32")
    layer = loaded.model.flat_layers.layers[0]
    assert DecodeStack._spec(layer.qkv) == (DecodeStack.LINEAR_PANEL, 0, layer.qkv.out_features)
    layer.o = object()  # a weight of some other kind
    assert DecodeStack.build(loaded.model.flat_layers) is None
