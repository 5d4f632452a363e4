"""OpenAI response bodies for completions and chat completions, whole and as stream chunks."""
from __future__ import annotations

import time

from shardserve.models.tokenizer import Tokenizer
from shardserve.request import RequestOutput, TokenLogprob
from shardserve.server.tool_calls import ToolCallFormat, ToolCallStream, message_tool_calls, parse


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], text_offset: int) -> dict:
    """The legacy completions logprobs object: parallel lists plus per-token top-N dicts."""
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def _tool_finish(reason: str | None) -> str | None:
    # OpenAI's reason when a reply ends in its calls; one cut off by max_tokens stays "length"
    return "tool_calls" if reason == "stop" else reason


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:  # skip_tokenizer_init: vLLM's spelling of a token it cannot show
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class ResponseBuilder:
    """Formats one API call's outputs; `index` is the choice index (prompt * n + sample)."""

    def __init__(self, kind: str, response_id: str, model: str, tokenizer: Tokenizer, want_logprobs: bool,
                 want_token_ids: bool = False, include_usage: bool = False, tools: ToolCallFormat | None = None):
        self.kind = kind  # "completion" | "chat"
        self.want_token_ids = want_token_ids
        self.include_usage = include_usage  # streams: `usage: null` on each chunk, then a usage chunk
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.tools = tools  # the format a chat reply's tool calls are read in (None: no tools)
        self._streams: dict[int, ToolCallStream] = {}  # per choice, while streaming with tools
        self._texts: dict[int, str] = {}

    def _envelope(self, chunk: bool) -> dict:
        obj = {"completion": "text_completion", "chat": "chat.completion"}[self.kind]
        if chunk and self.kind == "chat":
            obj = "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, finals: list[RequestOutput], prompt_tokens: int, echo_prefixes: list[str]) -> dict:
        choices = []
        for index, (out, prefix) in enumerate(zip(finals, echo_prefixes)):
            comp = out.outputs[0]
            logprobs = None
            if self.want_logprobs and comp.logprobs is not None:
                logprobs = (completion_logprobs(self.tokenizer, comp.logprobs, len(prefix)) if self.kind == "completion"
                            else chat_logprobs(self.tokenizer, comp.logprobs))
            choice = {"index": index, "logprobs": logprobs, "finish_reason": comp.finish_reason}
            if self.kind == "completion":
                choice["text"] = prefix + comp.text
            else:
                choice["message"] = {"role": "assistant", "content": comp.text, "refusal": None}
                if self.tools is not None:
                    reply = parse(self.tools, comp.text, final=True)
                    if reply.calls:
                        choice["message"].update(content=reply.content or None,
                                                 tool_calls=message_tool_calls(reply.calls))
                        choice["finish_reason"] = _tool_finish(comp.finish_reason)
            if self.want_token_ids:
                choice["token_ids"] = list(comp.token_ids)
            choices.append(choice)
        completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals)
        return {**self._envelope(False), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, index: int, out: RequestOutput | None, text: str, first: bool = False) -> dict:
        """One streamed delta for choice `index`; `out` carries the finish reason and logprobs."""
        finish = out.outputs[0].finish_reason if out is not None and out.finished else None
        logprobs = None
        if self.want_logprobs and out is not None and out.new_logprobs:
            entries = out.new_logprobs
            logprobs = (completion_logprobs(self.tokenizer, entries, 0) if self.kind == "completion"
                        else chat_logprobs(self.tokenizer, entries))
        if self.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif self.tools is not None and not first:
            stream = self._streams.setdefault(index, ToolCallStream(self.tools))
            self._texts[index] = self._texts.get(index, "") + text
            delta = stream.feed(self._texts[index], final=finish is not None)
            if stream.has_calls and finish is not None:
                finish = _tool_finish(finish)
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if self.want_token_ids:
            choice["token_ids"] = list(out.new_token_ids) if out is not None else []
        body = {**self._envelope(True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
