"""The flat layer loop (models/flat_layers.py) against the module path it stands in for: the same
hidden states and the same KV cache, bit for bit, on a step with decodes and prefill chunks."""
import pytest
import torch

from shardserve.config import CacheConfig, EngineConfig
from shardserve.engine.model_loader import load_model
from shardserve.layers.attention.paged_kv import SeqSpan
from shardserve.layers.cpu_kernels import load_add_rms_norm

pytestmark = pytest.mark.skipif(load_add_rms_norm() is None, reason="needs the native CPU kernels")


def load(path, dtype: str):
    return load_model(EngineConfig(model=str(path), dtype=dtype, max_model_len=256, show_progress=False,
                                   skip_tokenizer_init=True, cache=CacheConfig(kv_cache_memory_bytes=4 << 20)))


def run(loaded, flat, kv: list[torch.Tensor], spans: list[SeqSpan], num_decodes: int, ids, positions) -> torch.Tensor:
    loaded.model.flat_layers = flat
    meta = loaded.attention.build_metadata(spans, num_decodes, loaded.kv_cache)
    with torch.inference_mode():
        return loaded.model(ids, positions, kv, meta)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: the qkv bias
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
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
