"""The model's own sampling defaults: generation_config.json's sampling keys, the embedded
model's card values, nothing for a checkpoint that sets none; and where they apply (requests
that leave a field out, LLM.generate without params) and where not (--generation-config vllm)."""
from __future__ import annotations

import json
import shutil

import pytest

from shardserve.config import ConfigError
from shardserve.llm import LLM
from shardserve.models.sampling_defaults import sampling_defaults
from shardserve.request import SamplingParams
from shardserve.server.protocol import CompletionRequest


def test_the_embedded_model_takes_its_cards_values(smollm2_path):
    assert sampling_defaults("smollm2", smollm2_path) == {"temperature": 0.2, "top_p": 0.9}
    assert sampling_defaults(None, smollm2_path) == sampling_defaults("smollm2", smollm2_path)
    assert sampling_defaults(str(smollm2_path), smollm2_path) == {}  # a .gguf named by path: no card


def test_generation_config_sampling_keys_only(tmp_path, tiny_checkpoints):
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_length": 99}))
    assert sampling_defaults(str(folder), folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    for bad in ("{not json", json.dumps({"top_p": 0})):
        (folder / "generation_config.json").write_text(bad)
        with pytest.raises(ConfigError, match="generation_config.json"):
            sampling_defaults(str(folder), folder)
    (folder / "generation_config.json").unlink()
    assert sampling_defaults(str(folder), folder) == {}


def test_requests_that_leave_fields_out_take_the_models_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    body = CompletionRequest(prompt="hi", temperature=0)
    params = body.sampling_params(16, None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0, 0.95, 20, 0.0)
    assert CompletionRequest(prompt="hi").sampling_params(16, None, None, {}) == SamplingParams(max_tokens=16)


def test_llm_generate_without_params_uses_the_models_defaults_and_vllm_mode_does_not(tiny_checkpoints, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    engine_args = dict(kv_cache_memory_bytes=1 << 22, show_progress=False)
    with LLM(str(folder), **engine_args) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0)
        greedy = llm.generate([[5, 6, 7]] * 2)  # temperature 0 from the model: the same tokens twice
        assert greedy[0].outputs[0].token_ids == greedy[1].outputs[0].token_ids
        by_dict = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": llm.tokenizer.decode([5, 6, 7])}])
        assert by_dict[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    with LLM(str(folder), generation_config="vllm", **engine_args) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ConfigError, match="generation-config"):
        LLM(str(folder), generation_config="mine", **engine_args)
