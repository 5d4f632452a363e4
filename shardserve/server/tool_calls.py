"""Tool calling: how tools are shown to a model, how its calls are read back out of its text
(whole, or while it streams), and the grammar that forces a call for `tool_choice` "required"
or a named function.

Three formats, picked with `--tool-call-parser` (vLLM's names):
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
                 (Hermes, Qwen 2.5/3, SmolLM2 and most chatml-family models)
    llama3_json  the whole reply is {"name": ..., "parameters": {...}}, calls separated by ";"
                 (Llama 3.1+, optionally after <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

One parse rule serves both response shapes: `parse(text, final)` reads the content and the calls
out of the text so far, and a stream sends, at each step, only what that parse has added since
the previous one. Every field it reports only grows as text arrives, so the deltas concatenate
to exactly what the whole response says: no character of the arguments is dropped or sent
twice, however many tokens a step brings (the bug class vLLM and SGLang keep reopening comes
from parsers that track token boundaries instead of the text).

Arguments are reported as the model wrote them (a substring of its output); with a forced call
they were written under the tool's JSON schema.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from shardserve.engine.grammar import JSON_FORMAT


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # the marker that opens the tool-call part of a reply ("" for llama3_json: the reply itself)
    end: str  # closes one call (hermes), or "" when calls are JSON values in a row
    separator: str  # between calls ("" when each has its own markers)
    in_list: bool  # the calls are one JSON array after `start` (mistral)
    arguments_key: str


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "", False, "arguments"),
    "llama3_json": ToolCallFormat("llama3_json", "", "", ";", False, "parameters"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "", ",", True, "arguments"),
}
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a call with it
NEWLINE = "\\n"  # as a Lark string literal writes it


def tool_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


# --- what the model reads ---------------------------------------------------------------------

def system_prompt(fmt: ToolCallFormat, tools: list[dict]) -> str:
    """The tools and the call syntax, for a chat template that does not render tools itself."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, one JSON object per line:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            f"To call one, reply with {render_calls(fmt, [('NAME', {'ARGUMENT': 'VALUE'})])} "
            "using a function's name and a JSON object of its arguments; otherwise answer in plain text.")


def render_calls(fmt: ToolCallFormat, calls: list[tuple[str, dict | str]]) -> str:
    """Calls written the way the model writes them (for a system prompt and for history)."""
    def one(name: str, arguments: dict | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{fmt.arguments_key}": {args}}}'

    if fmt.name == "hermes":
        return "\n".join(f"{fmt.start}\n{one(n, a)}\n{fmt.end}" for n, a in calls)
    if fmt.in_list:
        return fmt.start + "[" + ", ".join(one(n, a) for n, a in calls) + "]"
    return "; ".join(one(n, a) for n, a in calls)


def forced_call_grammar(fmt: ToolCallFormat, tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's) that admits only calls of `tools`, with arguments valid
    under each one's parameters schema and naming only the parameters it declares (as OpenAI's
    strict mode does): one call, or up to 4 when `parallel`."""
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  fmt.arguments_key: _declared_only(t["function"].get("parameters"))},
                "required": ["name", fmt.arguments_key], "additionalProperties": False} for t in tools]
    schema = {"anyOf": options, "x-guidance": {**JSON_FORMAT, "lenient": True}}
    call = f"%json {json.dumps(schema)}"

    def repeat(separator: str, item: str) -> str:
        return f'{item} ("{separator}" {item}){{0,3}}' if parallel else item

    if fmt.name == "hermes":
        calls = repeat(NEWLINE, "call")
        return (f'start: {calls}\ncall: "{fmt.start}\\n" body "\\n{fmt.end}"\nbody: {call}\n')
    if fmt.in_list:
        return f'start: "{fmt.start}[" {repeat(", ", "body")} "]"\nbody: {call}\n'
    return f'start: {repeat("; ", "body")}\nbody: {call}\n'


def _declared_only(parameters: dict | None) -> dict:
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


# --- reading calls back ------------------------------------------------------------------------

@dataclass
class ParsedCall:
    name: str
    arguments: str  # as written; a prefix of it while it streams


@dataclass
class ParsedReply:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    calls_start: int | None = None  # where the tool-call part begins (None: no marker yet)


def parse(fmt: ToolCallFormat, text: str, final: bool, search_from: int = 0) -> ParsedReply:
    """The reply's content and calls in `text`. Before `final`, content stops short of anything
    that could still turn out to open a call (a marker's prefix, trailing whitespace). A call
    shows up once its name is complete; its arguments as far as they are written. If the final
    text has a marker but no readable call, it is all content. `search_from`: no marker starts
    before it (a stream has looked there already)."""
    start = _calls_start(fmt, text, search_from)
    if start is None:
        return ParsedReply(text if final else _hold_back(fmt, text))
    calls = _read_calls(fmt, text, start)
    if final and not calls:
        return ParsedReply(text, calls_start=start)
    return ParsedReply(text[:start].rstrip(), calls, start)


def _calls_start(fmt: ToolCallFormat, text: str, search_from: int = 0) -> int | None:
    if fmt.start:
        found = text.find(fmt.start, search_from)
        return None if found < 0 else found
    first = _skip_ws(text, 0)  # llama3_json: a reply that is a JSON object (or the python tag)
    return first if text.startswith("{", first) or text.startswith(PYTHON_TAG, first) else None


def _hold_back(fmt: ToolCallFormat, text: str) -> str:
    if not fmt.start:  # llama3_json: a reply opens as content once it does not open with "{"
        return "" if not text.strip() or PYTHON_TAG.startswith(text.lstrip()) else text
    for keep in range(min(len(fmt.start) - 1, len(text)), 0, -1):
        if fmt.start.startswith(text[-keep:]):
            text = text[:-keep]
            break
    return text.rstrip()


def _read_calls(fmt: ToolCallFormat, text: str, start: int) -> list[ParsedCall]:
    pos = start + len(fmt.start)
    if fmt.name == "llama3_json" and text.startswith(PYTHON_TAG, _skip_ws(text, start)):
        pos = _skip_ws(text, start) + len(PYTHON_TAG)
    if fmt.in_list:
        pos = _skip_ws(text, pos)
        if not text.startswith("[", pos):
            return []
        pos += 1
    calls = []
    while True:
        pos = _skip_ws(text, pos)
        if not text.startswith("{", pos):
            return calls
        fields, end = _object_fields(text, pos)
        name_span, args_span = fields.get("name"), fields.get(fmt.arguments_key)
        if name_span is None or name_span[1] is None:
            return calls
        try:
            name = json.loads(text[name_span[0]:name_span[1]])
        except ValueError:
            return calls
        if not isinstance(name, str):
            return calls
        args = "" if args_span is None else text[args_span[0]: len(text) if args_span[1] is None else args_span[1]]
        calls.append(ParsedCall(name, args))
        if end is None:
            return calls
        pos = _skip_ws(text, end)
        if fmt.end:  # hermes: </tool_call>, then maybe the next <tool_call>
            if not text.startswith(fmt.end, pos):
                return calls
            following = text.find(fmt.start, pos + len(fmt.end))
            if following < 0:
                return calls
            pos = following + len(fmt.start)
        elif text.startswith(fmt.separator, pos):
            pos += len(fmt.separator)
        else:
            return calls


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _object_fields(text: str, pos: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level members of the JSON object at `pos`: key -> (value start, value end or None
    while it is incomplete), and the object's end (None while it is open)."""
    fields: dict[str, tuple[int, int | None]] = {}
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if text.startswith("}", pos):
            return fields, pos + 1
        if text.startswith(",", pos):
            pos = _skip_ws(text, pos + 1)
        key_end = _value_end(text, pos) if text.startswith('"', pos) else None
        if key_end is None:
            return fields, None
        key = json.loads(text[pos:key_end])
        pos = _skip_ws(text, key_end)
        if not text.startswith(":", pos):
            return fields, None
        value_start = _skip_ws(text, pos + 1)
        if value_start >= len(text):
            return fields, None
        value_end = _value_end(text, value_start)
        fields[key] = (value_start, value_end)
        if value_end is None:
            return fields, None
        pos = value_end


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value starting at `pos` ends, or None if the text stops inside it."""
    opening = text[pos]
    if opening == '"':
        i = pos + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if opening in "{[":
        depth, i, in_string = 0, pos, False
        while i < len(text):
            ch = text[i]
            if in_string:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos  # number, true, false, null: ends at a delimiter
    while i < len(text) and text[i] not in ",}] \t\r\n;":
        i += 1
    return i if i < len(text) else None


# --- the response shapes -------------------------------------------------------------------------

def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calls: list[ParsedCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ToolCallStream:
    """One choice's stream: `feed` the whole text so far, get the delta to send."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.searched = 0  # no marker starts before this (so each step searches only new text)
        self.sent_content = 0
        self.sent: list[int] = []  # characters of each call's arguments sent
        self.ids: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.sent)

    def feed(self, text: str, final: bool) -> dict:
        """The delta ({"content": ..., "tool_calls": [...]}, either or both, or {})."""
        reply = parse(self.fmt, text, final, self.searched)
        if reply.calls_start is not None:
            self.searched = reply.calls_start
        elif self.fmt.start:  # a marker could still end in the last len(marker) - 1 characters
            self.searched = max(self.searched, len(text) - len(self.fmt.start) + 1)
        delta: dict = {}
        if len(reply.content) > self.sent_content:
            delta["content"] = reply.content[self.sent_content:]
            self.sent_content = len(reply.content)
        pieces = []
        for index, call in enumerate(reply.calls):
            if index == len(self.sent):
                self.ids.append(call_id())
                self.sent.append(0)
                pieces.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > self.sent[index]:
                pieces.append({"index": index, "function": {"arguments": call.arguments[self.sent[index]:]}})
                self.sent[index] = len(call.arguments)
        if pieces:
            delta["tool_calls"] = pieces
        return delta


# --- the request side -----------------------------------------------------------------------------

def template_inputs(fmt: ToolCallFormat, template: str | None, messages: list[dict],
                    tools: list[dict]) -> tuple[list[dict], dict]:
    """(messages, extra template arguments) for a conversation with `tools` (maybe none) and
    tool calls in its history. A template that renders tools itself gets them as `tools`, as HF
    templates expect; for one that does not, the tools become a system prompt in `fmt`'s syntax
    and earlier calls and results become text."""
    template = template or ""
    if "tool_calls" not in template:
        messages = [history_message(fmt, m) for m in messages]
    if not tools:
        return messages, {}
    if "tools" in template:
        return messages, {"tools": tools}
    prompt = system_prompt(fmt, tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]], {}
    return [{"role": "system", "content": prompt}, *messages], {}


def history_message(fmt: ToolCallFormat, message: dict) -> dict:
    """An assistant message with tool_calls, or a tool result, as plain text for a chat template
    that knows neither."""
    if message.get("tool_calls"):
        calls = [(c["function"]["name"], c["function"].get("arguments") or "{}") for c in message["tool_calls"]]
        text = ((message.get("content") or "") + "\n" + render_calls(fmt, calls)).lstrip("\n")
        return {"role": "assistant", "content": text}
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return message
