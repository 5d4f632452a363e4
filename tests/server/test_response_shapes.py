"""Every response body and stream chunk, read by the `openai` package's own models, with every
field that OpenAI's API reference (openai/openai-openapi) marks required present in what we sent
(null where it is nullable), never filled in by a model default."""
import json

import httpx
import pytest
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, chat_completion, chat_completion_chunk
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel

from tests.server.test_tool_calls import TOOLS

# the required members of each object, as the API reference lists them
REQUIRED = {
    Completion: {"id", "object", "created", "model", "choices"},
    CompletionChoice: {"finish_reason", "index", "logprobs", "text"},
    Logprobs: {"text_offset", "token_logprobs", "tokens", "top_logprobs"},
    CompletionUsage: {"prompt_tokens", "completion_tokens", "total_tokens"},
    ChatCompletion: {"id", "object", "created", "model", "choices"},
    chat_completion.Choice: {"finish_reason", "index", "message", "logprobs"},
    ChatCompletionMessage: {"content", "refusal", "role"},
    chat_completion.ChoiceLogprobs: {"content", "refusal"},
    ChatCompletionTokenLogprob: {"token", "logprob", "bytes", "top_logprobs"},
    TopLogprob: {"token", "logprob", "bytes"},
    ChatCompletionMessageFunctionToolCall: {"id", "type", "function"},
    Function: {"name", "arguments"},
    ChatCompletionChunk: {"id", "object", "created", "model", "choices"},
    chat_completion_chunk.Choice: {"delta", "finish_reason", "index"},
    chat_completion_chunk.ChoiceLogprobs: {"content", "refusal"},
    chat_completion_chunk.ChoiceDelta: set(),  # every member optional: a delta holds what is new
    chat_completion_chunk.ChoiceDeltaToolCall: {"index"},
    chat_completion_chunk.ChoiceDeltaToolCallFunction: set(),
    Model: {"id", "object", "created", "owned_by"},
}


def check(model: BaseModel, path: str = "") -> int:
    """Asserts the required members were sent, here and in every nested object; returns how many
    objects it checked (so a test knows the walk reached what it meant to)."""
    wanted = REQUIRED.get(type(model))
    assert wanted is not None, f"{path or type(model).__name__}: no table entry for {type(model).__name__}"
    missing = wanted - model.model_fields_set
    assert not missing, f"{path or type(model).__name__} lacks {sorted(missing)}"
    checked = 1
    for name in model.model_fields_set:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                checked += check(item, f"{path}.{name}[{i}]")
    return checked


def post(server: str, route: str, body: dict) -> dict:
    response = httpx.post(f"{server}/v1/{route}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def chunks(server: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server}/v1/{route}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": "smol", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
TOOL_CHAT = {**CHAT, "max_tokens": 60, "tools": TOOLS, "tool_choice": "required"}


@pytest.mark.parametrize("body", [COMPLETION, {**COMPLETION, "logprobs": 2, "echo": True}], ids=["plain", "logprobs"])
def test_completions(server, body):
    assert check(Completion.model_validate(post(server, "completions", body))) >= 3
    usage_seen = False
    for raw in chunks(server, "completions", {**body, "stream_options": {"include_usage": True}}):
        assert "usage" in raw  # null on every chunk, then the counts
        # the package types a completion's finish_reason as never null, yet OpenAI's own streams
        # send null until the last chunk (as we do): that one member is checked here instead
        for choice in raw["choices"]:
            assert "finish_reason" in choice
            choice["finish_reason"] = choice["finish_reason"] or "length"
        parsed = Completion.model_validate(raw)
        check(parsed)
        usage_seen |= parsed.usage is not None
    assert usage_seen


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "logprobs": True, "top_logprobs": 2}, TOOL_CHAT],
                         ids=["plain", "logprobs", "tool_calls"])
def test_chat_completions(server, body):
    whole = ChatCompletion.model_validate(post(server, "chat/completions", body))
    assert check(whole) >= 4
    if body is TOOL_CHAT:
        assert whole.choices[0].message.tool_calls
    raws = chunks(server, "chat/completions", {**body, "stream_options": {"include_usage": True}})
    for raw in raws:
        assert "usage" in raw
        check(ChatCompletionChunk.model_validate(raw))
    assert raws[0]["choices"][0]["delta"]["role"] == "assistant"
    assert raws[-1]["choices"] == [] and raws[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_models(server):
    listing = httpx.get(f"{server}/v1/models").json()
    assert listing["object"] == "list"
    for card in listing["data"] + [httpx.get(f"{server}/v1/models/smol").json()]:
        check(Model.model_validate(card))


def test_stream_events_keep_unicode_line_separators_escaped():
    """A model's text may hold U+2028, U+2029 or U+0085: raw in an SSE event they would split it
    for readers that end lines as str.splitlines does; escaped, the event is one line and the
    same JSON."""
    from shardserve.server.api import _event

    payload = {"choices": [{"text": "a\u2028b\x85c\u2029d é"}]}
    event = _event(payload)
    assert event.endswith("\n\n") and len(event.rstrip("\n").splitlines()) == 1
    assert json.loads(event.removeprefix("data: ")) == payload and "é" in event
