"""Speculative decoding (n-gram proposals, engine/speculator.py): a request's tokens are the same
with speculation on and off, greedy and seeded, whatever else the step holds; proposals that do
not hold are rolled back; stop conditions met inside a verified chunk end the request there."""
from __future__ import annotations

import random

import pytest

from shardserve.config import ConfigError
from shardserve.llm import LLM
from shardserve.request import Resume, SamplingParams

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
          "policy": "always"}


def tiny_llm(path, speculative_config=None, **kwargs) -> LLM:
    args = dict(dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=512, show_progress=False)
    return LLM(str(path), speculative_config=speculative_config, **{**args, **kwargs})


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    """Prompts that repeat a phrase (something to look up) and plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(2, 384) for _ in range(rng.randrange(3, 12))]
        out.append(phrase * rng.randrange(2, 5) if i % 2 == 0 else [rng.randrange(2, 384) for _ in range(40)])
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_same_tokens_with_and_without_speculation(tiny_checkpoints, family):
    plain, spec = tiny_llm(tiny_checkpoints[family]), tiny_llm(tiny_checkpoints[family], ALWAYS)
    for params in (GREEDY, SEEDED):
        batch = prompts(1)
        expected = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
        got = [o.outputs[0].token_ids for o in spec.generate(batch, params)]
        assert got == expected, params.temperature
    stats = spec.engine.speculator.stats
    # both outcomes happened: proposals that held (several tokens a step) and ones rolled back
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_same_tokens_with_chunked_prefill_prefix_cache_and_preemption(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    batch = prompts(2, 8)
    expected = [o.outputs[0].token_ids for o in tiny_llm(path).generate(batch, GREEDY)]
    # 10 blocks of 16 tokens for 8 requests growing to 4-6 blocks: preemptions; prompts in chunks of 7
    block_bytes = 2 * 2 * 2 * 16 * 16 * 2  # layers x (K, V) x kv heads x head_dim x block x bf16
    spec = tiny_llm(path, ALWAYS, kv_cache_memory_bytes=10 * block_bytes, max_num_batched_tokens=64,
                    max_prefill_chunk_tokens=7, max_model_len=128)
    assert spec.engine.block_manager.num_blocks == 10
    got = [o.outputs[0].token_ids for o in spec.generate(batch, GREEDY)]
    again = [o.outputs[0].token_ids for o in spec.generate(batch, GREEDY)]  # prompts now in the prefix cache
    assert got == expected and again == expected
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.speculator.stats.num_accepted_tokens > 0


def test_seeded_request_resumes_exactly_with_speculation(tiny_checkpoints):
    llm = tiny_llm(tiny_checkpoints["llama"], ALWAYS)
    prompt = prompts(3)[0]
    full = llm.generate([prompt], SEEDED)[0].outputs[0].token_ids
    for cut in (1, 17):
        engine = llm.engine
        rest = SamplingParams(**{**SEEDED.__dict__})
        engine.add_request(f"resumed-{cut}", prompt, rest, resume=Resume(tuple(full[:cut])))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final.outputs[0].token_ids == full


def test_stops_inside_a_verified_chunk_end_the_request_there(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain, spec = tiny_llm(path), tiny_llm(path, ALWAYS)
    batch = prompts(4)
    free = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY)]
    stop_ids = sorted({ids[20] for ids in free})  # each output's 21st token stops it (or an earlier one)
    for params in (SamplingParams(temperature=0, max_tokens=48, stop_token_ids=stop_ids),
                   SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2,
                                  repetition_penalty=1.3)):
        expected = plain.generate(batch, params)
        got = spec.generate(batch, params)
        for e, g in zip(expected, got):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (e.outputs[0].finish_reason,
                                                                               e.outputs[0].stop_reason)
            assert g.outputs[0].logprobs == e.outputs[0].logprobs


def test_stop_string_inside_a_verified_chunk(smollm2_path):
    args = dict(dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256, show_progress=False)
    text = "Repeat exactly: one two three four five six seven eight.\nRepeat exactly: one two three four"
    params = SamplingParams(temperature=0, max_tokens=40, stop=[" six"])
    expected = LLM("smollm2", **args).generate(text, params)[0].outputs[0]
    spec = LLM("smollm2", speculative_config=ALWAYS, **args)
    got = spec.generate(text, params)[0].outputs[0]
    assert (got.text, got.token_ids, got.stop_reason) == (expected.text, expected.token_ids, " six")
    assert spec.engine.speculator.stats.num_accepted_tokens > 0


def test_speculative_config_errors():
    with pytest.raises(ConfigError, match="unknown speculative method"):
        tiny_llm("smollm2", {"method": "eagle3"})
    with pytest.raises(ConfigError, match="unknown speculative_config keys"):
        tiny_llm("smollm2", {"method": "ngram", "num_speculative_token": 3})


# --- a draft model ------------------------------------------------------------------------------
def draft_config(path, **extra) -> dict:
    return {"model": str(path), "num_speculative_tokens": 3, "policy": "always", **extra}


def test_the_target_as_its_own_draft_is_accepted_every_time(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    batch = prompts(5)
    expected = [o.outputs[0].token_ids for o in tiny_llm(path).generate(batch, GREEDY)]
    spec = tiny_llm(path, draft_config(path))
    got = [o.outputs[0].token_ids for o in spec.generate(batch, GREEDY)]
    stats = spec.engine.speculator.stats
    assert got == expected
    # greedy guesses of the same model are its own greedy tokens: every proposal holds, and a
    # step yields 1 + 3 tokens per request (fewer only where max_tokens cuts it short)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.num_drafts <= len(batch) * (GREEDY.max_tokens // 4 + 1)


@pytest.mark.parametrize("family,draft", [("llama", "llama_small"), ("qwen2", "llama_small"), ("mixtral", "llama")])
def test_a_different_draft_changes_no_token(tiny_checkpoints, family, draft):
    """A smaller random draft (the tiny models share their 384-token vocabulary) is mostly wrong:
    greedy and seeded outputs stay the target's own, with preemptions too."""
    path = tiny_checkpoints[family]
    batch = prompts(6, 8)
    plain = tiny_llm(path, max_model_len=128)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 2
    spec = tiny_llm(path, draft_config(tiny_checkpoints[draft]), max_model_len=128,
                    kv_cache_memory_bytes=10 * block_bytes if family == "llama" else 16 << 20)
    for params in (GREEDY, SEEDED):
        assert ([o.outputs[0].token_ids for o in spec.generate(batch, params)]
                == [o.outputs[0].token_ids for o in plain.generate(batch, params)]), params.temperature
    stats = spec.engine.speculator.stats
    assert 0 <= stats.num_accepted_tokens < stats.num_draft_tokens
    if family == "llama":
        assert spec.engine.scheduler.num_preemptions > 0


def test_a_gguf_target_drafted_by_its_own_blocks(tmp_path):
    """The draft is the target's GGUF kept in its blocks (`quantization: gguf`), the target the
    same file dequantized: the target's tokens, and most of the quantized copy's guesses hold."""
    from gguf import GGMLQuantizationType as QType

    from shardserve.layers.block_quant import BlockWeight, kernels_available
    from tests.layers.test_block_quant import _tiny_gguf

    if not kernels_available():
        pytest.skip("no native toolchain")
    path = _tiny_gguf(tmp_path, lambda name: QType.Q8_0)
    batch = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 40, 41, 42, 43]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # the target dequantized (a .gguf alone would keep its blocks too: then every guess would hold)
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, quantization="none")
    plain = tiny_llm(path, **kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    spec = tiny_llm(path, draft_config(path, quantization="gguf"), **kwargs)
    assert [o.outputs[0].token_ids for o in spec.generate(batch, params)] == expected
    target_head = spec.engine.runner.model.lm_head
    assert not isinstance(target_head.packed, BlockWeight)
    stats = spec.engine.speculator.stats
    print(f"\nQ8_0 draft of its dequantized target: {stats.num_accepted_tokens} of {stats.num_draft_tokens} guesses held")
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0


def test_draft_model_errors(tiny_checkpoints):
    with pytest.raises(ConfigError, match="takes a draft `model`"):
        tiny_llm(tiny_checkpoints["llama"], {"method": "draft_model"})
    with pytest.raises(ConfigError, match="speculative `quantization` is the draft model's"):
        tiny_llm(tiny_checkpoints["llama"], {"method": "ngram", "quantization": "gguf"})
    with pytest.raises(ConfigError, match="unknown draft quantization 'q3'"):
        tiny_llm(tiny_checkpoints["llama"], draft_config(tiny_checkpoints["llama"], quantization="q3"))
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        tiny_llm(tiny_checkpoints["llama"], {"model": "smollm2"})


def test_a_draft_probe_asks_for_one_request_s_guesses():
    """A draft catches up on every token it skipped: the policy's probe (no cost line yet) asks it
    for one request's guesses, not every request's (whole-context prefills of the draft on a busy
    server); other answers ask for every request's."""
    from shardserve.config import SpeculativeConfig
    from shardserve.engine.speculator import Speculator
    from shardserve.request import Request

    speculator = Speculator(SpeculativeConfig(model="draft", num_speculative_tokens=3))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(), seed=0) for i in range(4)]
    decoding = [(r, 100) for r in requests]
    assert speculator.propose(decoding, 4) == {}  # nothing guessed yet
    assert speculator.policy.probing and (speculator.num_draft_tokens, speculator.num_draft_requests) == (1, 1)
    speculator.keep_drafts({"r0": [7]})
    assert speculator.propose(decoding, 4) == {}  # no line yet, no new probe: the guess is dropped
    assert not speculator.policy.probing
    assert (speculator.num_draft_tokens, speculator.num_draft_requests) == (0, None)
    always = Speculator(SpeculativeConfig(model="draft", num_speculative_tokens=3, policy="always"))
    always.keep_drafts({"r0": [7, 8, 9], "r2": [4, 5]})
    assert always.propose(decoding, 4) == {"r0": [7, 8, 9], "r2": [4, 5]}
    assert (always.num_draft_tokens, always.num_draft_requests) == (3, None)
