"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams)` and `chat(...)`."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm import tqdm

from shardserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from shardserve.engine.launcher import build_engine
from shardserve.request import RequestOutput, SamplingParams

Prompt = str | list[int]


# vLLM's argument names -> ours
VLLM_NAMES = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size"}


def engine_config_from_kwargs(model: str, **kwargs) -> EngineConfig:
    """Flat keyword arguments (as users pass them to vLLM's LLM) -> nested EngineConfig."""
    nested = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
    kwargs = {VLLM_NAMES.get(key, key): value for key, value in kwargs.items()}
    if "speculative_config" in kwargs:  # vLLM's name, as a dict or None
        spec = kwargs.pop("speculative_config")
        kwargs["speculative"] = SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
    parts: dict[str, dict] = {name: {} for name in nested}
    top: dict = {"model": model}
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in nested.items()}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for key, value in kwargs.items():
        owner = next((name for name, names in fields.items() if key in names), None)
        if owner:
            parts[owner][key] = value
        elif key in engine_fields:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(**top, **{name: cls(**parts[name]) for name, cls in nested.items()})


class LLM:
    def __init__(self, model: str = "smollm2", **kwargs):
        self.engine = build_engine(engine_config_from_kwargs(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel replica; the LLM is unusable afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's prompt dicts: {"prompt": text} and
        {"prompt_token_ids": ids}); outputs come back in prompt order. Without sampling params,
        the model's own defaults (`get_default_sampling_params`)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        req_ids = [str(next(self._ids)) for _ in prompts]
        for req_id, prompt, p in zip(req_ids, prompts, params_list):
            self.engine.add_request(req_id, prompt, p)
        return self._run(req_ids, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        self.engine.validator.require_tokenizer("messages", "chat")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(req_ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.req_id] = out
                        bar.update(1)
        return [finished[r] for r in req_ids]


def _prompt_of(prompt: Prompt | dict) -> Prompt:
    """A prompt as text or token ids; vLLM's TextPrompt / TokensPrompt dicts are unwrapped."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
