"""A checkpoint folder without a tokenizer, served as vLLM's skip_tokenizer_init serves it:
token ids in, token ids out (the same ones the engine with a tokenizer samples), and a clear
refusal for whatever needs text."""
from __future__ import annotations

import shutil

import httpx
import pytest

from shardserve.config import CacheConfig, ConfigError, EngineConfig
from shardserve.engine.launcher import build_engine
from shardserve.request import InvalidRequestError, SamplingParams, StructuredOutputs
from tests.server_process import running_server


@pytest.fixture(scope="module")
def bare_folder(tiny_checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_tokenizer") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return folder


def config(model, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(model), show_progress=False, cache=CacheConfig(kv_cache_memory_bytes=1 << 22), **kwargs)


def generate(engine, prompt_ids: list[int], params: SamplingParams):
    engine.add_request("r", prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final.outputs[0]


def test_token_ids_in_and_out_as_with_a_tokenizer(tiny_checkpoints, bare_folder):
    with_tokenizer = build_engine(config(tiny_checkpoints["llama"]))
    bare = build_engine(config(bare_folder, skip_tokenizer_init=True))
    prompt = with_tokenizer.tokenizer.encode("The quick brown fox")
    for params in (SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0.9, seed=3)):
        ref, got = generate(with_tokenizer, prompt, params), generate(bare, prompt, params)
        assert got.token_ids == ref.token_ids and ref.text and got.text == ""


def test_what_needs_text_is_refused_naming_the_field(bare_folder):
    bare = build_engine(config(bare_folder, skip_tokenizer_init=True))
    for prompt, params, param in [("hello", SamplingParams(), "prompt"),
                                  ([5, 6], SamplingParams(stop=("x",)), "stop"),
                                  ([5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a+")), "structured_outputs")]:
        with pytest.raises(InvalidRequestError, match="without one") as err:
            bare.add_request("r", prompt, params)
        assert err.value.param == param
    assert not bare.has_unfinished_requests()


def test_without_the_flag_a_missing_tokenizer_is_a_config_error(bare_folder):
    with pytest.raises(ConfigError, match="tokenizer"):
        build_engine(config(bare_folder))


def test_server_answers_token_ids_and_refuses_chat(bare_folder):
    with running_server("--model", str(bare_folder), "--skip-tokenizer-init", "--kv-cache-memory", str(4 << 20)) as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                          "logprobs": 1, "return_token_ids": True}, timeout=60).json()
        choice = reply["choices"][0]
        assert len(choice["token_ids"]) == 5 and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for route, body, param in [("v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                                   ("v1/completions", {"prompt": "hi"}, "prompt"), ("tokenize", {"prompt": "hi"}, "prompt")]:
            refused = httpx.post(f"{url}/{route}", json=body, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
