"""Tool calls: reading each format's calls out of text, whole and streamed in pieces of every
size (the deltas must add up to the whole parse, character for character), the prompt and
grammar sides, and the API end to end with the `openai` client."""
import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from shardserve.engine.grammar import Grammars
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.tokenizer import load_tokenizer
from shardserve.request import SamplingParams, StructuredOutputs
from shardserve.server.protocol import ChatMessage
from shardserve.server.tool_calls import (FORMATS, ToolCallStream, forced_call_grammar, parse, render_calls,
                                          template_inputs)

CALLS = [("get_weather", '{"city": "Paris, \\"FR\\"", "days": [1, 2], "opts": {"unit": "c"}}'),
         ("add", '{"a": 1, "b": -22.5e1, "ok": true, "none": null}')]


def replies(fmt):
    calls = render_calls(fmt, CALLS)
    if fmt.name == "llama3_json":
        return {"calls": calls, "tagged": "<|python_tag|>" + calls}
    return {"calls": calls, "content and calls": "Let me check. " + calls}


@pytest.mark.parametrize("name", list(FORMATS))
def test_whole_replies_give_content_and_calls_as_written(name):
    fmt = FORMATS[name]
    for kind, text in replies(fmt).items():
        reply = parse(fmt, text, final=True)
        assert [(c.name, c.arguments) for c in reply.calls] == CALLS, kind
        assert reply.content == ("Let me check." if kind == "content and calls" else "")
        for call in reply.calls:
            json.loads(call.arguments)
    plain = "No tool needed: it is sunny {maybe}."
    assert parse(fmt, plain, final=True).content == plain and not parse(fmt, plain, final=True).calls


def stream_pieces(fmt, text: str, cuts: list[int]):
    stream, deltas = ToolCallStream(fmt), []
    for i, end in enumerate(cuts):
        deltas.append(stream.feed(text[:end], final=i == len(cuts) - 1))
    content = "".join(d.get("content", "") for d in deltas)
    names, args = {}, {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in names, "a call's header is sent once"
                names[piece["index"]] = piece["function"]["name"]
            args[piece["index"]] = args.get(piece["index"], "") + piece["function"].get("arguments", "")
    return content, [(names[i], args.get(i, "")) for i in sorted(names)]


@pytest.mark.parametrize("name", list(FORMATS))
def test_streamed_deltas_add_up_to_the_whole_parse_whatever_the_step_sizes(name):
    """Each step may bring one character or many tokens at once: for 200 random ways to cut the
    text, the streamed content and arguments equal the whole reply's, byte for byte."""
    fmt = FORMATS[name]
    rng = random.Random(0)
    texts = list(replies(fmt).values()) + ["Plain answer, no calls.", "<tool_call> not json", "[TOOL_CALLS] nope"]
    for text in texts:
        whole = parse(fmt, text, final=True)
        expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
        cut_sets = [list(range(1, len(text) + 1)), [len(text)]]
        cut_sets += [sorted(set(rng.sample(range(1, len(text)), rng.randint(1, 12))) | {len(text)}) for _ in range(200)]
        for cuts in cut_sets:
            assert stream_pieces(fmt, text, cuts) == expected, (text, cuts)


def test_content_that_may_open_a_call_is_held_back_until_it_is_known():
    fmt = FORMATS["hermes"]
    stream = ToolCallStream(fmt)
    assert stream.feed("Sure <tool_", final=False) == {"content": "Sure"}
    assert stream.feed("Sure <tool_ish thing", final=True) == {"content": " <tool_ish thing"}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def grammars():
    tokenizer = load_tokenizer(load_checkpoint(None))
    return tokenizer, Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize("name", list(FORMATS))
def test_forced_call_grammar_admits_the_tools_calls_and_nothing_else(grammars, name):
    tokenizer, compiler = grammars
    fmt = FORMATS[name]
    spec = StructuredOutputs(grammar=forced_call_grammar(fmt, TOOLS, parallel=True))

    def accepts(text: str) -> bool:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        matcher = compiler.matcher(spec, [])
        return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert accepts(render_calls(fmt, [("get_weather", {"city": "Oslo", "unit": "celsius"})]))
    assert accepts(render_calls(fmt, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "unit": "fahrenheit"})]))
    assert not accepts(render_calls(fmt, [("delete_all", {})]))  # not a tool
    assert not accepts(render_calls(fmt, [("add", {"a": 1})]))  # a required argument missing
    assert not accepts(render_calls(fmt, [("add", {"a": 1, "b": 2, "c": 3})]))  # one it does not declare
    assert not accepts("I will not call anything.")


def test_a_template_without_tools_gets_them_as_a_system_prompt_and_history_as_text():
    fmt = FORMATS["hermes"]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "c1"}]
    messages, extra = template_inputs(fmt, "{{ messages }}", history, TOOLS)
    assert extra == {} and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == render_calls(fmt, [("get_weather", {"city": "Oslo"})])
    assert messages[3]["content"] == '<tool_response>\n{"temp": 3}\n</tool_response>'
    messages, extra = template_inputs(fmt, "{% for t in tools %}{% endfor %}{{ m.tool_calls }}", history, TOOLS)
    assert extra == {"tools": TOOLS} and messages == history


# --- over HTTP, on the embedded model -------------------------------------------------------------

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed(client, **kwargs):
    content, names, args, finish = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.function and piece.function.name:
                names[piece.index] = piece.function.name
            args[piece.index] = args.get(piece.index, "") + (piece.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    return content, [(names[i], args[i]) for i in sorted(names)], finish


@pytest.mark.parametrize("tool_choice, sampling", [
    ("required", dict(temperature=0)),
    ({"type": "function", "function": {"name": "get_weather"}}, dict(temperature=1.0, seed=5)),
], ids=["required-greedy", "named-seeded"])
def test_forced_tool_calls_whole_and_streamed_are_byte_identical(client, tool_choice, sampling):
    kwargs = dict(model="smol", messages=WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                  parallel_tool_calls=False, **sampling)
    with ThreadPoolExecutor(2) as pool:  # both at once: they share the server's steps
        whole_reply, streamed_reply = pool.submit(client.chat.completions.create, **kwargs), pool.submit(
            streamed, client, **kwargs)
        whole, (content, calls, finish) = whole_reply.result(), streamed_reply.result()
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert (content, calls, finish) == ("", [(call.function.name, call.function.arguments)], "tool_calls")


def test_tool_choice_none_and_a_conversation_with_tool_results(client, offline):
    none = client.chat.completions.create(model="smol", messages=WEATHER, tools=TOOLS, tool_choice="none",
                                          max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model="smol", messages=WEATHER, max_tokens=12, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'}]
    reply = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    # the model saw the call and its result: the prompt the server's template path renders from
    # them, and the greedy reply the offline engine gives to that prompt
    tokenizer = offline.tokenizer
    rendered, extra = template_inputs(FORMATS["hermes"], tokenizer.chat_template,
                                      [ChatMessage(**m).for_template() for m in history], TOOLS)
    prompt = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **extra)
    assert '"sky": "clear"' in prompt and "get_weather" in prompt
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt))
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert reply.usage.completion_tokens == len(expected.token_ids)
    message = reply.choices[0].message  # (SmolLM2 answers with text here: no call to parse)
    assert not message.tool_calls and message.content == expected.text


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol", messages=WEATHER, max_tokens=8, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
