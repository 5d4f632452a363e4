"""Resuming a request from another replica's tokens: the continuation is the tokens and text
the uninterrupted run produced (greedy and seeded), without repeating delivered text."""
from __future__ import annotations

import pytest

from shardserve.config import CacheConfig, EngineConfig
from shardserve.engine.launcher import build_engine
from shardserve.request import InvalidRequestError, Resume, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return build_engine(EngineConfig(model=str(tiny_checkpoints["llama"]), show_progress=False,
                                  cache=CacheConfig(kv_cache_memory_bytes=1 << 22)))


def stream(engine, req_id, prompt, params, resume=None):
    engine.add_request(req_id, prompt, params, resume=resume)
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append((out.new_text, list(out.new_token_ids)))
            final = out
    return pieces, final


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 9, 20])
def test_resumed_request_continues_exactly(engine, params, cut):
    prompt = "The quick brown fox"
    pieces, full = stream(engine, f"full-{cut}", prompt, params)
    tokens = full.outputs[0].token_ids
    # what a client had after `cut` tokens: their ids, and the text streamed with them
    delivered_text = "".join(text for text, _ in pieces[:cut])
    resumed_pieces, resumed = stream(engine, f"resumed-{cut}", prompt, params,
                                     Resume(tuple(tokens[:cut]), len(delivered_text)))
    assert resumed.outputs[0].token_ids == tokens
    assert sum((ids for _, ids in resumed_pieces), []) == tokens[cut:]
    assert delivered_text + "".join(text for text, _ in resumed_pieces) == full.outputs[0].text


def test_resume_without_budget_is_rejected(engine):
    with pytest.raises(InvalidRequestError, match="no token budget left"):
        engine.add_request("r", "hi", SamplingParams(max_tokens=2), resume=Resume((5, 6)))


@pytest.fixture(scope="module")
def bf16_llm():
    from shardserve.llm import LLM
    return LLM("smollm2", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_model_len=512, show_progress=False)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=104, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=104, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_bf16_resume_from_k_tokens_is_exact(bf16_llm, params):
    """The embedded model served as `make serve` does (bfloat16): a request recomputed from its
    prompt and its first k tokens (the prefill path, a prefix-cache hit for the prompt) continues
    with the tokens the uninterrupted run decoded one step at a time."""
    prompts = [bf16_llm.tokenizer.encode(text) for text in
               ("Write a short poem about the sea:", "Explain how a CPU cache works.", "List three uses of copper.")]
    prompts.append(list(range(1000, 1150)))  # a long prompt: several key blocks before the first token
    full = [out.outputs[0].token_ids for out in bf16_llm.generate(prompts, params)]
    for k in (1, 16, 100):
        rest = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - k})
        resumed = bf16_llm.generate([p + f[:k] for p, f in zip(prompts, full)], rest)
        assert [out.outputs[0].token_ids for out in resumed] == [f[k:] for f in full], f"k={k}"


RESUME_MODES = {  # how the resumed request's prefix is recomputed
    "prefix-cache": dict(enable_prefix_caching=True),  # the prompt's blocks hit the cache
    "chunked": dict(enable_prefix_caching=False, max_num_batched_tokens=48),  # in chunks of <= 48 tokens
}


@pytest.mark.parametrize("mode", list(RESUME_MODES))
@pytest.mark.parametrize("family", ["llama", "mixtral"], ids=["dense", "moe"])
def test_bf16_resume_is_exact_on_tiny_dense_and_moe_models(tiny_checkpoints, family, mode):
    """Random tiny models in bfloat16, 8 prompts of 3-150 tokens decoded together, greedy and
    seeded: re-run from the prompt plus the first k tokens, each continues exactly."""
    from shardserve.llm import LLM
    import random
    llm = LLM(str(tiny_checkpoints[family]), dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=512,
              show_progress=False, **RESUME_MODES[mode])
    rng = random.Random(family)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 9, 17, 33, 40, 64, 100, 150)]
    for params in (SamplingParams(max_tokens=104, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=104, temperature=1.0, seed=5, ignore_eos=True)):
        full = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        for k in (1, 16, 100):
            rest = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - k})
            resumed = llm.generate([p + f[:k] for p, f in zip(prompts, full)], rest)
            assert [out.outputs[0].token_ids for out in resumed] == [f[k:] for f in full], (params.temperature, k)
