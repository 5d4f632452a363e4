"""The embedded SmolLM2 GGUF, loaded by us and by transformers' own GGUF loader."""
import pytest
import torch

from shardserve import SamplingParams
from shardserve.layers.block_quant import BlockWeight
from shardserve.llm import LLM
from tests.engine_helpers import engine_logits, hf_greedy, relative_error

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the boiling point of water?\nA:",
    "Large language models",
    "The three primary colors are red,",
    "import torch\nimport numpy as np\n\n# Load the data and train a small model on it. First we",
]


@pytest.fixture(scope="module")
def pair(smollm2_reference):
    # dequantized as transformers dequantizes (the blocks kept: tests/layers/test_block_quant.py)
    ours = LLM("smollm2", dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
               show_progress=False)
    return ours, smollm2_reference


def test_none_dequantizes_the_gguf(pair):
    ours, _ = pair
    assert not isinstance(ours.engine.executor.runner.model.lm_head.packed, BlockWeight)


def test_logits_match_transformers_gguf(pair):
    ours, ref = pair
    for text in TEXTS[:3]:
        ids = ours.tokenizer.encode(text)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        assert relative_error(engine_logits(ours.engine, ids, 10**6), expected) <= 1e-3


def test_greedy_generation_matches_transformers_gguf(pair):
    ours, ref = pair
    batch = [ours.tokenizer.encode(t) for t in TEXTS]
    outs = ours.generate(batch, SamplingParams(temperature=0, max_tokens=10, min_tokens=10))
    for ids, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 10)


def test_capital_of_france(pair):
    ours, _ = pair
    out = ours.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].text.startswith(" Paris")
