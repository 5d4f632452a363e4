"""Our decoder (dense and MoE families) against transformers' own implementation on the same weights."""
import random

import pytest
import torch
import transformers

from shardserve import SamplingParams
from shardserve.llm import LLM
from tests.engine_helpers import engine_logits, hf_greedy, relative_error

FAMILIES = ["llama", "mistral", "qwen2", "llama3", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    ours = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=512, show_progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, ours, ref


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in (1, 3, 7, 16, 17, 33, 60, 120)]


@pytest.mark.parametrize("chunk_size", [10**6, 5, 1], ids=["prefill", "chunked", "decode"])
def test_logits_match_transformers(pair, chunk_size):
    family, ours, ref = pair
    for ids in prompts(384)[2:6]:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        got = engine_logits(ours.engine, ids, chunk_size)
        assert relative_error(got, expected) <= 1e-4, family


def test_greedy_generation_matches_transformers(pair):
    family, ours, ref = pair
    batch = prompts(384, seed=1)
    # min_tokens masks EOS like transformers' min_new_tokens, so both run the full 12 tokens
    outs = ours.generate(batch, SamplingParams(temperature=0, max_tokens=12, min_tokens=12))
    for ids, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 12), family


def test_a_tied_embedding_is_held_once_in_the_heads_panels(tiny_checkpoints):
    path = tiny_checkpoints["llama3"]  # tie_word_embeddings
    ours = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=512, show_progress=False)
    model = ours.engine.runner.model
    if model.lm_head.packed is None or not model.lm_head.packed.gathers_rows:
        pytest.skip("no panel kernel on this host")
    # the logits tests above run through this lookup; here: no second copy is left behind
    assert model.embed_tokens.shared is model.lm_head.packed and model.embed_tokens.weight.numel() == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.arange(ref.config.vocab_size)
    assert torch.equal(model.embed_tokens(ids), ref.get_input_embeddings().weight.detach())
