"""LLMEngine / LLM public behaviour on the embedded model."""
import pytest

from shardserve import SamplingParams
from shardserve.layers.block_quant import BlockWeight
from shardserve.llm import LLM
from shardserve.request import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256, show_progress=False)


def test_the_embedded_gguf_is_served_from_its_blocks(llm):
    # no --quantization: a .gguf on a CPU keeps its blocks (tests/models/test_smollm2.py: "none")
    assert isinstance(llm.engine.executor.runner.model.lm_head.packed, BlockWeight)


def test_seeded_request_resumes_exactly_from_its_first_k_tokens(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = llm.tokenizer.encode("Write a short poem about the sea:")
    full = llm.generate([prompt], params)[0].outputs[0].token_ids
    k = 7
    resumed = llm.generate([prompt + full[:k]], SamplingParams(**{**params.__dict__, "max_tokens": 20 - k}))
    assert resumed[0].outputs[0].token_ids == full[k:]


def test_step_streams_deltas_that_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", "Tell me about Paris.", SamplingParams(temperature=0, max_tokens=20))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final.finished and "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].finish_reason in ("stop", "length")


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("x", "Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    out = engine.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.usage == 0 and not engine.has_unfinished_requests()


def test_stop_string_and_stop_reason(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20, stop=["\n"]))[0]
    assert out.outputs[0].text == " Paris." and out.outputs[0].stop_reason == "\n"


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert out.outputs[0].text  # a reply, not the turn's end straight away


def test_greedy_tokens_without_logits_are_those_of_the_logits():
    """Plain greedy requests take the LM head's fused argmax (the panel kernel's epilogue, which
    never writes the logits); asking for logprobs makes the same batch go through the full logits
    and the sampler: the tokens must agree. (The GGUF blocks' head argmaxes its logits in both.)"""
    llm = LLM("smollm2", dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=256,
              show_progress=False)
    head = llm.engine.runner.model.lm_head.packed
    assert not isinstance(head, BlockWeight)
    if not head.fused:
        pytest.skip("this build has no fused epilogues (AVX2)")
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3,", "Once upon a time"]
    fused = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    via_logits = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in via_logits]


def test_logprobs_returned_per_token(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    assert all(lp.top[0][0] == lp.token_id and lp.logprob <= 0 for lp in out.logprobs)


@pytest.mark.parametrize("prompt, message", [("", "empty"), ([], "empty"), ([1] * 300, "context window"),
                                             ([10**6], "token ids")])
def test_bad_prompts_are_rejected(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt if prompt == "" else [prompt], SamplingParams())


def test_warm_up_runs_a_step_and_leaves_nothing_behind(llm):
    engine = llm.engine
    seeds, cached = engine._seeds.getstate(), dict(engine.block_manager.cached)
    engine.last_step = None
    engine.warm_up()
    assert engine.last_step is not None  # it ran steps
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0
    assert engine._seeds.getstate() == seeds  # unseeded requests draw the same seeds as without it
    assert engine.block_manager.cached == cached  # no full block of it in the prefix cache
