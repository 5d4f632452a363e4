"""The OpenAI-compatible HTTP API (FastAPI). Handlers validate and tokenize, submit to the
AsyncEngine, and answer whole or as a server-sent-event stream.

Status codes: 400 invalid parameters or prompt; 401 a missing or wrong API key (auth.py); 404
unknown model; 413 a body over the size limit (limits.py); 429 (with Retry-After) when the waiting
queue is full; 503 when the engine is dead. Bad input never yields a 5xx.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardserve import __version__
from shardserve.request import InvalidRequestError, RequestOutput, Resume, StructuredOutputs
from shardserve.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestSpec, RequestStream
from shardserve.server.metrics import ServerMetrics
from shardserve.server.protocol import (ENGINE_STUCK_S, PROGRESS_COMMENT, PROGRESS_INTERVAL_S, ChatCompletionRequest,
                                       CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body)
from shardserve.server.responses import ResponseBuilder
from shardserve.server.tool_calls import ToolCallFormat, forced_call_grammar, template_inputs, tool_format


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass
class Call:
    """One API call: its engine requests (prompt x n) and how to format them."""

    specs: list[RequestSpec]
    builder: ResponseBuilder
    prompt_tokens: int
    echo_prefixes: list[str]
    num_resumed_tokens: int = 0  # output tokens another replica already produced (resume)


def build_app(async_engine: AsyncEngine, metrics: ServerMetrics, model_name: str, model_info: dict | None = None,
              tool_call_parser: str = "hermes") -> FastAPI:
    """The API over `async_engine`; tool calls are read and written in `tool_call_parser`'s
    format (server/tool_calls.py)."""
    app = FastAPI(title="shardserve", version=__version__)
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    tools_format: ToolCallFormat = tool_format(tool_call_parser)
    _install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model")

    def make_specs(body, prompts: list[list[int]], num_logprobs: int | None, max_tokens: int | None,
                   constraint: StructuredOutputs | None = None) -> list[RequestSpec]:
        specs = []
        base = uuid.uuid4().hex
        constraint = constraint or body.structured_output_spec()  # once, not once per choice
        for p_index, ids in enumerate(prompts):
            budget = engine.validator.token_budget(ids, max_tokens)
            for i in range(body.n):
                seed = None if body.seed is None else body.seed + i
                params = body.sampling_params(min(16, budget) if max_tokens is None else max_tokens, num_logprobs, seed,
                                              engine.sampling_defaults, constraint)
                specs.append(RequestSpec(f"{base}-{p_index}-{i}", ids, params, body.effective_priority, resume(body, ids, params)))
        if specs:  # they share their parameters: checked (a constraint compiled) once, here
            engine.validator.sampling(specs[0].params)
        return specs

    def chat_prompt(messages, add_generation_prompt: bool, tools: list[dict] = ()) -> str:
        """The conversation (and the tools it may call) through the model's chat template (400 if
        the template refuses it)."""
        engine.validator.require_tokenizer("messages", "a chat")
        rendered, extra = template_inputs(tools_format, tokenizer.chat_template, [m.for_template() for m in messages],
                                          list(tools))
        try:
            return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # a template's raise_exception: the conversation is malformed
            raise APIError(400, f"chat template rejected the messages: {exc}", "messages") from None

    def resume(body, ids: list[int], params) -> Resume | None:
        if body.resume_token_ids is None:
            return None
        if body.n != 1 or len(_split_prompts(getattr(body, "prompt", ""))) != 1:
            raise APIError(400, "resume_token_ids needs exactly one prompt and n = 1", "resume_token_ids")
        engine.validator.resume(ids, params, body.resume_token_ids)
        return Resume(tuple(body.resume_token_ids), body.resume_text_chars)

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            raise APIError(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "shardserve",
            "max_model_len": engine.max_model_len, **(model_info or {})}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # a model id may hold slashes (a checkpoint path)
    async def model(name: str):
        check_model(name)
        return card

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = _split_prompts(body.prompt)
        ids = [engine.validator.prompt_ids(p) for p in prompts]
        specs = make_specs(body, ids, body.logprobs, body.max_tokens)
        echo_wanted = body.echo and body.resume_token_ids is None  # a resumed stream has sent its echo
        echo = [p if isinstance(p, str) and echo_wanted else "" for p in prompts for _ in range(body.n)]
        builder = ResponseBuilder("completion", f"cmpl-{uuid.uuid4().hex}", model_name, tokenizer,
                                  body.logprobs is not None, body.return_token_ids, body.include_usage)
        call = Call(specs, builder, sum(len(i) for i in ids), echo, len(body.resume_token_ids or ()))
        return await _answer(async_engine, call, body.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        tools, forced = body.active_tools(), body.forced_tools()
        text = chat_prompt(body.messages, body.add_generation_prompt, tools)
        ids = engine.validator.prompt_ids(text, add_special_tokens=False)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        constraint = None
        if forced:  # the grammar admits only calls of these tools, with schema-valid arguments
            if body.structured_output_spec() is not None:
                raise APIError(400, "a forced tool_choice cannot be combined with response_format or "
                                    "structured_outputs", "tool_choice")
            constraint = StructuredOutputs(grammar=forced_call_grammar(tools_format, forced, body.parallel_tool_calls),
                                           source="tool_choice")
        specs = make_specs(body, [ids], num_logprobs, body.max_completion_tokens or body.max_tokens, constraint)
        builder = ResponseBuilder("chat", f"chatcmpl-{uuid.uuid4().hex}", model_name, tokenizer, body.logprobs,
                                  body.return_token_ids, body.include_usage, tools_format if tools else None)
        call = Call(specs, builder, len(ids), [""] * len(specs), len(body.resume_token_ids or ()))
        return await _answer(async_engine, call, body.stream, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        engine.validator.require_tokenizer("prompt", "/tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either a prompt or messages", "prompt")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            ids = tokenizer.encode(chat_prompt(body.messages, body.add_generation_prompt, tools), add_special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        engine.validator.require_tokenizer("tokens", "/detokenize")
        engine.validator.check_vocab(body.tokens, "tokens", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def _split_prompts(prompt) -> list[str | list[int]]:
    """One prompt (text or token ids) or a batch of them -> the list of prompts. An empty one is
    kept as it is, for the validator to refuse."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _submit(async_engine: AsyncEngine, specs: list[RequestSpec]) -> list[RequestStream]:
    if len(specs) > async_engine.max_waiting_requests:  # could never be admitted: not a retry case
        raise APIError(400, f"the request asks for {len(specs)} generations (prompts x n); this server "
                            f"queues at most {async_engine.max_waiting_requests} at once", "n")
    try:
        return async_engine.submit(specs)
    except QueueFullError as exc:
        raise APIError(429, f"server is at capacity ({exc}); retry later", headers={"Retry-After": "1"}) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None


async def _answer(async_engine: AsyncEngine, call: Call, stream: bool, request: Request):
    streams = _submit(async_engine, call.specs)
    if stream:
        return StreamingResponse(_sse(async_engine, call, streams), media_type="text/event-stream")
    collect = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
    try:
        while not collect.done():
            await asyncio.wait({collect}, timeout=0.5)
            if not collect.done() and await request.is_disconnected():
                collect.cancel()
                return Response(status_code=499)
        finals = collect.result()
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    finally:
        for s in streams:
            s.close()
    return call.builder.full(finals, call.prompt_tokens, call.echo_prefixes)


async def _last(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out


async def _sse(async_engine: AsyncEngine, call: Call, streams: list[RequestStream]) -> AsyncIterator[str]:
    """Interleave the choices' deltas as they come; `data: [DONE]` ends the stream; a progress
    comment when nothing came for a while (protocol.PROGRESS_INTERVAL_S). If the client goes
    away, the generator is closed and `finally` aborts every unfinished request."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await merged.put((index, out))
        except Exception as exc:
            await merged.put((index, exc))
        await merged.put((index, None))

    received = 0  # items taken from `merged`

    async def tick() -> None:
        """A progress sentinel after each interval in which nothing came (one timer a stream,
        not one per token)."""
        seen = 0
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            if received == seen and async_engine.making_progress(ENGINE_STUCK_S):
                await merged.put((-1, PROGRESS_COMMENT))
            seen = received

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)] + [asyncio.ensure_future(tick())]
    completion_tokens, open_choices = call.num_resumed_tokens, len(streams)
    try:
        for index, prefix in enumerate(call.echo_prefixes):
            if prefix or (call.builder.kind == "chat" and not call.num_resumed_tokens):
                yield _event(call.builder.chunk(index, None, prefix, first=True))
        while open_choices:
            index, item = await merged.get()
            if item is PROGRESS_COMMENT:
                yield item
                continue
            received += 1
            if item is None:
                open_choices -= 1
                continue
            if isinstance(item, Exception):
                yield _event(error_body(503, f"generation failed: {item}"))
                break
            completion_tokens += len(item.new_token_ids)
            if item.new_text or item.finished or (call.builder.want_token_ids and item.new_token_ids):
                yield _event(call.builder.chunk(index, item, item.new_text))
        if call.builder.include_usage:
            yield _event(call.builder.usage_chunk(call.prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


# Characters JSON may carry raw that line readers built on str.splitlines (httpx's aiter_lines,
# among others) take for line ends: escaped, so an event stays one line for every client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(InvalidRequestError)  # the validator's and SamplingParams' refusals
    async def invalid_request(_, exc: InvalidRequestError):
        return JSONResponse(error_body(400, str(exc), exc.param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"),
                                status_code=400)
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(400, message, loc[0] if loc else None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)
