"""Puts an engine in the state whose next `engine.step()` is a chosen batch, using its public
request API and scheduler, so that the step the profiler measures is an ordinary serving step.

Prompts are random token ids (distinct per request, so nothing hits the prefix cache). To start
`num_seqs` decodes at `context_len` the prompts must first be prefilled; in a single-process
engine that prefill is skipped ("fast-forward"): the scheduler admits and allocates the requests
as usual and the model runner registers them, but the forward pass is not run and each gets a
placeholder first token. Their KV entries stay zeros, which costs a decode step exactly what real
keys and values would (the kernels do not look at the values), and setting up 32 decodes at
1024 tokens takes milliseconds instead of a minute of prefill. A parallel replica's workers only
see whole steps, so there the prompts are prefilled for real.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from shardserve.engine.engine import LLMEngine
from shardserve.engine.interface import ModelRunnerOutput, SampledToken
from shardserve.request import SamplingParams


class ControlledBatches:
    """Adds and removes the profiler's requests. `params` are the sampling parameters of every
    request (greedy by default: what the benchmarks replay); max_tokens is set per request."""

    def __init__(self, engine: LLMEngine, seed: int = 0, params: SamplingParams | None = None):
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.params = params or SamplingParams(temperature=0.0)
        self._ids = itertools.count()
        vocab = engine.model_config.vocab_size
        # skip the low ids where special tokens usually live, when the vocabulary allows it
        self._token_range = (min(100, vocab // 4), vocab)

    def add_prompts(self, num_seqs: int, prompt_len: int) -> list[str]:
        """Queue `num_seqs` new requests of `prompt_len` random tokens; they generate until aborted."""
        max_tokens = max(2, self.engine.max_model_len - prompt_len - 1)
        params = dataclasses.replace(self.params, max_tokens=max_tokens, min_tokens=0, ignore_eos=True,
                                     stop=(), stop_token_ids=())
        req_ids = []
        for _ in range(num_seqs):
            req_id = f"profile-{next(self._ids)}"
            tokens = self.rng.integers(*self._token_range, size=prompt_len).tolist()
            self.engine.add_request(req_id, tokens, params)
            req_ids.append(req_id)
        return req_ids

    def start_decodes(self, num_seqs: int, context_len: int) -> list[str]:
        """`num_seqs` running requests whose next step is a decode attending `context_len` tokens:
        prompts of context_len - 1 tokens, prefilled, with one generated token each."""
        req_ids = self.add_prompts(num_seqs, context_len - 1)
        if self.engine.config.parallel.world_size == 1:  # no other ranks to keep in step
            self._fast_forward(req_ids)
        else:
            while any(not self._request(r).output_token_ids for r in req_ids):
                self.engine.step()
        return req_ids

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.engine.abort_request(req_id)

    def _request(self, req_id: str):
        return self.engine.scheduler.requests[req_id]

    def _fast_forward(self, req_ids: list[str]) -> None:
        """Schedule steps until every request has its first token, without running the model."""
        scheduler, runner = self.engine.scheduler, self.engine.runner
        while any(not self._request(r).output_token_ids for r in req_ids):
            sched = scheduler.schedule()
            if sched.is_empty:
                raise RuntimeError("the KV cache cannot hold the profiler's sequences; lower the sweep")
            runner.update_states(sched)
            placeholder = int(self._token_range[0])
            sampled = {seq.req_id: [SampledToken(placeholder)] for seq in sched.seqs if seq.sample}
            scheduler.update(sched, ModelRunnerOutput(sampled))
            runner.record(sampled)
