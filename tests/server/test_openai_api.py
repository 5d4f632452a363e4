"""The server through the official `openai` client (sync, async, streaming) and raw HTTP, with
outputs checked against the offline engine on the same seeds."""
import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from shardserve import SamplingParams
from tests.server_process import scrape

PROMPT = "The three primary colors are"


def test_completion_matches_offline_engine_greedy_and_seeded(client, offline):
    for params in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7)):
        got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=24, **params)
        ref = offline.generate(PROMPT, SamplingParams(max_tokens=24, **params))[0].outputs[0]
        assert got.choices[0].text == ref.text
        assert got.choices[0].finish_reason == ref.finish_reason
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert got.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))


def test_streaming_completion_concatenates_to_the_same_text(client):
    whole = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0)
    stream = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_completion_stream_and_whole(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert whole.choices[0].message.content == ref and whole.choices[0].message.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == ref


def test_n_choices_prompt_lists_and_token_id_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    prompts = [PROMPT, "Hello"]
    got = client.completions.create(model="smol", prompt=prompts, n=2, max_tokens=5, seed=3, temperature=1.0, top_p=1.0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    # choice i of each prompt samples with seed + i, as that prompt alone would offline
    expected = [offline.generate(p, SamplingParams(max_tokens=5, temperature=1.0, top_p=1.0, seed=3 + i))[0].outputs[0].text
                for p in prompts for i in range(2)]
    assert [c.text for c in got.choices] == expected and expected[0] != expected[1]
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_logprobs_are_the_offline_engine_s(client, offline):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    comp = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == comp.choices[0].text
    ref = offline.generate(PROMPT, params)[0].outputs[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref], abs=1e-5)
    for top, expected in zip(lp.top_logprobs, ref):  # {token text: logprob}, the best two
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in expected.top], abs=1e-5)
        assert set(top) == {offline.tokenizer.decode([t]) for t, _ in expected.top}
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="smol", messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    ref = offline.chat(messages, params)[0].outputs[0].logprobs
    assert len(content) == 3
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in ref], abs=1e-5)
    for token, expected in zip(content, ref):
        assert [(t.token, t.logprob) for t in token.top_logprobs] == [
            (offline.tokenizer.decode([i]), pytest.approx(v, abs=1e-5)) for i, v in expected.top]


def test_async_client_concurrent_requests(server, offline):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
        prompts = [f"Count to {i}:" for i in range(6)]
        return prompts, await asyncio.gather(*(client.completions.create(
            model="smol", prompt=p, max_tokens=10, temperature=0) for p in prompts))

    prompts, results = asyncio.run(main())
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert [r.choices[0].text for r in results] == [r.outputs[0].text for r in refs]


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "smol", "prompt": ', 400, None),
    (b'{"model": "smol"}', 400, "prompt"),
    (b'{"model": "smol", "prompt": "hi", "top_p": 2}', 400, "top_p"),
    (b'{"model": "smol", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "smol", "prompt": "hi", "max_tokens": 5000}', 400, "max_tokens"),
    (b'{"model": "smol", "prompt": ""}', 400, "prompt"),
    (b'{"model": "smol", "prompt": [999999999]}', 400, "prompt"),
    (b'{"model": "smol", "prompt": "' + b"word " * 1100 + b'"}', 400, "prompt"),
    (b'{"model": "other", "prompt": "hi"}', 404, "model"),
    (b'{"model": "smol", "prompt": "hi", "stop": [' + b",".join([b'"s"'] * 17) + b']}', 400, "stop"),
    (b'{"model": "smol", "messages": []}', 400, "messages"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    resp = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == ("model_not_found" if status == 404 else None)  # a string or null, never the status
    if param:
        assert error["param"] == param


def test_health_models_version_metrics(server, client):
    assert httpx.get(f"{server}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(f"{server}/version").json()["version"]
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
             "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"]
    for name in names:
        scrape(server, name)
    assert scrape(server, "vllm:generation_tokens_total") > 0


def stream_events(server: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a raw SSE stream (which must end with [DONE])."""
    with httpx.stream("POST", server + path, json={**body, "stream": True}, timeout=60) as resp:
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_usage_is_null_on_every_chunk_before_the_usage_chunk(server, path, body):
    """OpenAI's stream_options.include_usage: `"usage": null` on each chunk, then one chunk with
    no choices and the usage; without the option, no chunk carries the field."""
    body = {"model": "smol", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    with_usage = stream_events(server, path, {**body, "stream_options": {"include_usage": True}})
    assert len(with_usage) > 2 and all("usage" in c and c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 6
    assert not any("usage" in c for c in stream_events(server, path, body))


def test_chat_message_has_refusal_null(server):
    resp = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    message = resp.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None


def test_retrieve_model(server, client):
    card = client.models.retrieve("smol")
    assert card.id == "smol" and card.object == "model"
    missing = httpx.get(f"{server}/v1/models/other", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_tokenize_and_detokenize_round_trip(server, offline):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""
    tok = httpx.post(f"{server}/tokenize", json={"model": "smol", "prompt": PROMPT}, timeout=10).json()
    assert tok["tokens"] == offline.tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=10).json()
    template = offline.tokenizer.apply_chat_template(messages)
    assert chat["tokens"] == offline.tokenizer.encode(template, add_special_tokens=False)
    back = httpx.post(f"{server}/detokenize", json={"model": "smol", "tokens": tok["tokens"]}, timeout=10).json()
    assert back["prompt"] == offline.tokenizer.decode(tok["tokens"])
    for path, body, param in (("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"model": "other", "prompt": "a"}, "model")):
        refused = httpx.post(f"{server}{path}", json=body, timeout=10)
        assert 400 <= refused.status_code < 500 and refused.json()["error"]["param"] == param


def test_omitted_sampling_fields_take_the_models_defaults(client, offline):
    """The embedded model's card values (temperature 0.2, top_p 0.9) for what the request leaves
    out: a seeded request without them samples as the offline engine does with them."""
    got = client.completions.create(model="smol", prompt=PROMPT, max_tokens=24, seed=11)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.2, top_p=0.9, seed=11))[0].outputs[0]
    assert got.choices[0].text == ref.text
    hot = client.completions.create(model="smol", prompt=PROMPT, max_tokens=24, seed=11, temperature=1.0)
    ref_hot = offline.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11))[0].outputs[0]
    assert hot.choices[0].text == ref_hot.text  # a field given wins; the others still default


def test_the_readme_first_example_answers_sensibly_with_default_sampling(server):
    """The quick start's curl body, as it is (the model's own sampling defaults), ten seeds."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))
    assert set(body) == {"model", "messages", "max_tokens"}  # no sampling field: the defaults decide
    async def ten_tries():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{server}/v1/chat/completions", json={**body, "model": "smol",
                                                                                             "seed": seed})
                                          for seed in range(10)))

    for reply in asyncio.run(ten_tries()):
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
