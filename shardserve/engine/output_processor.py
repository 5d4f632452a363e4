"""What a step's sampled tokens mean to the caller: per request, the detokenizer (text and stop
strings), the logprobs and the prompt text, turned into RequestOutputs.

Each step's output is a delta (`new_text`, `new_token_ids`, `new_logprobs`): a stream of n tokens
costs O(n) in all. The whole completion (text, token ids, logprobs) is assembled once, when the
request finishes, or when the caller asks for it (`output`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.engine.interface import SampledToken
from shardserve.request import CompletionOutput, Request, RequestOutput, Resume, TokenLogprob


@dataclass
class OutputState:
    """One request's output so far, beyond the token ids the scheduler keeps."""

    detokenizer: IncrementalDetokenizer
    prompt: str | None  # the prompt text, when it came as text
    logprobs: list[TokenLogprob] | None = field(default=None)  # None: not asked for


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, OutputState] = {}

    def add(self, req: Request, prompt: str | None, resume: Resume | None = None) -> None:
        """Start a request's output; a resumed one takes its tokens so far as generated, and the
        text the client already has (`resume.num_text_chars`) is not sent again."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        if resume is not None:
            for token_id in resume.output_token_ids:
                detokenizer.push(token_id)
            detokenizer.skip(resume.num_text_chars)
        logprobs = [] if req.params.logprobs is not None else None
        self.states[req.req_id] = OutputState(detokenizer, prompt, logprobs)

    def process(self, updated: list[Request], sampled: dict[str, list[SampledToken]],
                stop_request: Callable[[str, str], None]) -> list[RequestOutput]:
        """Outputs of the requests that got tokens this step (`updated`, from the scheduler).
        A request whose text reached a stop string is ended through `stop_request(req_id, stop)`;
        tokens it got after the one that completed the stop string are dropped."""
        now = time.monotonic()
        outputs = []
        for req in updated:
            if req.first_token_time is None:
                req.first_token_time = now
            state = self.states[req.req_id]
            tokens = sampled[req.req_id]
            for i, token in enumerate(tokens):
                stop = state.detokenizer.push(token.token_id)
                if stop is not None:
                    if not req.is_finished:
                        del req.output_token_ids[len(req.output_token_ids) - (len(tokens) - 1 - i):]
                        stop_request(req.req_id, stop)
                    tokens = tokens[:i + 1]
                    break
            new_logprobs = []
            if state.logprobs is not None:
                new_logprobs = [TokenLogprob(t.token_id, t.logprob, t.top_logprobs) for t in tokens]
                state.logprobs.extend(new_logprobs)
            new_text = state.detokenizer.take_new_text(req.is_finished)
            outputs.append(self._output(req, new_text, [t.token_id for t in tokens], new_logprobs))
        return outputs

    def finish(self, req: Request) -> RequestOutput:
        """The final output of a request ended outside a step (an abort: nobody reads on)."""
        return self._output(req, "", [], [])

    def output(self, req: Request) -> RequestOutput:
        """The request's whole output so far, on demand (nothing new is handed out)."""
        return self._output(req, "", [], [], whole=True)

    def _output(self, req: Request, new_text: str, new_token_ids: list[int], new_logprobs: list[TokenLogprob],
                whole: bool = False) -> RequestOutput:
        finished = req.is_finished
        state = self.states.pop(req.req_id) if finished else self.states[req.req_id]
        completions = []
        if finished or whole:
            detok = state.detokenizer
            text = detok.text if finished else detok.text[: detok.num_emitted_chars]
            completions.append(CompletionOutput(
                index=0, text=text, token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason.value if finished else None, stop_reason=req.stop_reason,
                logprobs=state.logprobs))
        return RequestOutput(
            req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, outputs=completions, finished=finished,
            new_text=new_text, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            num_cached_tokens=req.num_cached_tokens, prompt=state.prompt, arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )
