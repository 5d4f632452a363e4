"""A request's greedy output must not depend on what else the engine is doing (float32)."""
import random

import pytest

from shardserve import SamplingParams
from shardserve.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_llm(**kwargs) -> LLM:
    args = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024, show_progress=False)
    args.update(kwargs)
    return LLM("smollm2", **args)


@pytest.fixture(scope="module")
def probe_and_alone():
    llm = make_llm()
    probe = llm.tokenizer.encode(
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg")
    alone = llm.generate([probe], GREEDY)[0].outputs[0].token_ids
    return llm, probe, alone


def mixed_batch(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 200))] for _ in range(n)]


def test_same_in_a_batch_of_32_mixed_requests(probe_and_alone):
    llm, probe, alone = probe_and_alone
    batch = mixed_batch(0, 31)
    params = [SamplingParams(temperature=0, max_tokens=random.Random(i).randrange(1, 20), ignore_eos=True) for i in range(31)]
    outs = llm.generate(batch[:15] + [probe] + batch[15:], params[:15] + [GREEDY] + params[15:])
    assert outs[15].outputs[0].token_ids == alone


def test_same_with_prefix_cache_hit(probe_and_alone):
    llm, probe, alone = probe_and_alone
    llm.generate([probe], GREEDY)  # other tests may have evicted it: cache it again
    out = llm.generate([probe], GREEDY)[0]
    assert out.num_cached_tokens == 16 * (len(probe) // 16)
    assert out.outputs[0].token_ids == alone


def test_same_with_small_prefill_chunks(probe_and_alone):
    _, probe, alone = probe_and_alone
    llm = make_llm(max_prefill_chunk_tokens=3, enable_prefix_caching=False)
    outs = llm.generate(mixed_batch(1, 3) + [probe], GREEDY)
    assert outs[-1].outputs[0].token_ids == alone


def test_same_after_forced_preemption(probe_and_alone):
    _, probe, alone = probe_and_alone
    # 12 blocks of 16 tokens: four requests growing to 3-4 blocks each cannot all fit at once
    llm = make_llm(kv_cache_memory_bytes=12 * 16 * 46080, max_model_len=128, enable_prefix_caching=False)
    batch = [p[:40] for p in mixed_batch(2, 8) if len(p) >= 40][:3]
    outs = llm.generate(batch + [probe], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs[-1].outputs[0].token_ids[:12] == alone
