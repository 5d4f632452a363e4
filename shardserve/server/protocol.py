"""OpenAI request schemas (pydantic) and the OpenAI error shape.

Field names and defaults follow the OpenAI API; the engine's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) are accepted as vLLM accepts them.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardserve.request import MODEL_DEFAULT_FIELDS, InvalidRequestError, SamplingParams, StructuredOutputs


BATCH_PRIORITY = 10  # lower runs first: interactive requests default to 0
MAX_STOP_STRINGS = 16  # each one is searched for in every step's new text
# A stream that sent nothing during one of these intervals gets an SSE comment (`: progress`,
# which clients ignore) while its engine is making progress, so it is never silent for two: a
# router tells a queued or slow request from a dead replica by it (its stall timeout must be
# longer). An engine loop stuck in one step for ENGINE_STUCK_S sends none.
PROGRESS_INTERVAL_S = 1.0
ENGINE_STUCK_S = 30.0
PROGRESS_COMMENT = ": progress\n\n"


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _schema_text(schema: dict | str | bool) -> str:
    # one text per schema whatever the key order, so equal schemas share a compiled grammar
    return json.dumps(json.loads(schema) if isinstance(schema, str) else schema, sort_keys=True)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the model's default (generation_config.json), else SamplingParams'
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # engine extras (vLLM-compatible names)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # "batch" work runs after interactive work (a worse priority) and is preempted first
    request_class: Literal["interactive", "batch"] | None = None
    # for a router: each choice's token ids in the response; and continuing a request another
    # replica started (n == 1): its output tokens so far and the characters already delivered
    return_token_ids: bool = False
    resume_token_ids: list[int] | None = None
    resume_text_chars: int = Field(default=0, ge=0)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output_spec(self) -> StructuredOutputs | None:
        """The request's output constraint, from whichever field gave it (at most one may)."""
        specs = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(StructuredOutputs(json_object=True, source="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema", "response_format")
            specs.append(StructuredOutputs(json=self._schema(fmt.json_schema.schema_, "response_format"),
                                             source="response_format"))
        so = self.structured_outputs
        if so is not None:
            specs.append(StructuredOutputs(
                json=None if so.json_ is None else self._schema(so.json_, "structured_outputs"),
                json_object=bool(so.json_object), regex=so.regex, choice=tuple(so.choice or ()),
                grammar=so.grammar, source="structured_outputs"))
        legacy = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        for name, value in legacy.items():
            if value is None:
                continue
            kind = name.removeprefix("guided_")
            value = self._schema(value, name) if kind == "json" else tuple(value) if kind == "choice" else value
            specs.append(StructuredOutputs(**{kind: value}, source=name))
        if len(specs) > 1:
            raise InvalidRequestError("give at most one of response_format, structured_outputs and guided_*",
                                      specs[1].source)
        return specs[0] if specs else None

    @staticmethod
    def _schema(schema, field: str) -> str:
        try:
            return _schema_text(schema)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{field}: the JSON schema is not valid JSON ({exc})", field) from None

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk (and every chunk before it has `usage: null`)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def effective_priority(self) -> int:
        return max(self.priority, BATCH_PRIORITY) if self.request_class == "batch" else self.priority

    def sampling_params(self, default_max_tokens: int, num_logprobs: int | None, seed: int | None,
                        model_defaults: dict[str, float],
                        structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
        """The engine's SamplingParams; fields the request left out take `model_defaults` first.
        `structured_outputs`: the request's constraint (structured_output_spec, or one the server
        adds for a forced tool call), computed once by the caller for all its choices."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        chosen = {name: getattr(self, name) for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is not None}
        return SamplingParams(
            **{**model_defaults, **chosen},
            max_tokens=self.max_tokens or default_max_tokens, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=num_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (HF's convention: tool calls with their
        arguments as objects)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def active_tools(self) -> list[dict]:
        """The tools the model is shown: all of them, or none with tool_choice "none"
        (OpenAI's default is "auto" when there are tools)."""
        if self.forces_tool_call and not self.tools:
            raise InvalidRequestError("a forced tool_choice needs tools", "tool_choice")
        if not self.tools or self.tool_choice == "none":
            return []
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools have duplicate function names", "tools")
        return tools

    def forced_tools(self) -> list[dict]:
        """The tools a reply must call one of: all with "required", the named one when one is
        named, none otherwise."""
        tools = self.active_tools() if self.forces_tool_call else []
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
            if not tools:
                raise InvalidRequestError(f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                          "which is not in tools", "tool_choice")
        return tools

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages (through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # with messages: counted as the chat endpoint shows them
    add_special_tokens: bool = True  # for a prompt; a chat template writes its own
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's: a string or null (the HTTP status is the status line's)


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 413: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded",
               500: "internal_server_error", 503: "service_unavailable"}


# the codes OpenAI's API reference names; any other error has code null
ERROR_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    code = "model_not_found" if status == 404 and param == "model" else ERROR_CODES.get(status)
    return ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "error"),
                                           param=param, code=code)).model_dump()
