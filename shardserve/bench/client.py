"""Async load client for OpenAI-compatible `/v1/completions` servers (shardserve, vLLM, llama.cpp).

Every request streams (`stream=True`, `stream_options.include_usage`) so the client sees each
chunk arrive. One scheduler covers both load shapes:
  open loop    each request is sent at its `arrival_time_s`, whether or not earlier ones finished
               (optionally at most `concurrency` in flight: later ones wait for a free slot);
  closed loop  all arrivals at 0 and `concurrency` slots: C workers, each sending its next
               request as soon as its previous one ends.
TTFT and E2E are measured from the moment a request is actually sent, so time spent waiting for a
client slot is not charged to the server (it is kept as `start_s - scheduled_s`).

Usage from a script:
    specs = build_workload(WorkloadConfig(num_requests=64, input_len=128, output_len=128))
    result = run_benchmark_sync("http://127.0.0.1:8000", specs, concurrency=8)
"""
from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from shardserve.bench.stats import SLO, BenchResult, LoadLevel, RequestRecord, summarize_run
from shardserve.config import ConfigError
from shardserve.sim.workload import RequestSpec


class BenchClientError(ConfigError):
    """The benchmark cannot start (server unreachable, no model listed): a ConfigError, since the
    fix is the user's (--base-url, --model), and the CLI prints it as one line."""


@dataclass(frozen=True)
class ClientConfig:
    """How each request is sent. `extra_body` is merged last into every request body (it may
    override the defaults, e.g. `{"cache_prompt": false}` for llama.cpp); treat it as read-only."""

    base_url: str
    model: str | None = None  # None: the first id that GET /v1/models lists
    timeout_s: float = 600.0  # bound on each request, from send to the end of its stream
    ignore_eos: bool = True  # exact output lengths, so runs are comparable across servers
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    show_progress: bool = True


def api_root(base_url: str) -> str:
    """`http://host:port`, `.../` and `.../v1` all name the same API; return the `.../v1` form."""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that `GET /v1/models` lists."""
    url = api_root(base_url) + "/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise BenchClientError(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchClientError(f"{url} did not answer an OpenAI model list; pass the model name explicitly") from None


def request_body(spec: RequestSpec, model: str, config: ClientConfig) -> dict[str, Any]:
    """The `/v1/completions` body for one request."""
    body = {
        "model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
        "temperature": config.temperature, "ignore_eos": config.ignore_eos,
        "stream": True, "stream_options": {"include_usage": True},
    }
    return {**body, **config.extra_body}


@dataclass
class _InFlight:
    """What one request has shown so far; filled while its stream is read, so a request cut off by
    the timeout still reports the chunks it got."""

    start_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    usage_output_tokens: int | None = None
    status_code: int | None = None
    error: str | None = None


async def _stream_completion(client: httpx.AsyncClient, url: str, body: dict, state: _InFlight, t0: float) -> None:
    async with client.stream("POST", url, json=body) as response:
        state.status_code = response.status_code
        if response.status_code != 200:
            await response.aread()
            state.error = f"HTTP {response.status_code}: {_error_message(response.text)}"
            return
        async for line in _sse_lines(response):
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                return
            now_s = time.perf_counter() - t0
            try:
                event = json.loads(payload)
            except json.JSONDecodeError:
                state.error = f"bad stream event: {payload[:120]!r}"
                return
            if "error" in event:
                state.error = f"error in stream: {_error_message(json.dumps(event))}"
                return
            if _chunk_text(event):
                state.chunk_times_s.append(now_s)
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                state.usage_output_tokens = usage["completion_tokens"]


async def _sse_lines(response: httpx.Response):
    """The stream's lines, ended by LF, CR LF or CR only, as SSE defines them (httpx's aiter_lines
    also splits at U+2028, U+0085 and the like, which JSON may carry raw inside a string)."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if pending:
        yield pending


def _chunk_text(event: dict) -> str:
    """The generated text of one stream event (completions `text`, or a chat `delta.content`)."""
    text = ""
    for choice in event.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:300]
    except (ValueError, AttributeError):
        pass
    return text.strip()[:300] or "(empty body)"


async def _run_one(client: httpx.AsyncClient, model: str, index: int, spec: RequestSpec, config: ClientConfig,
                   t0: float, slots: asyncio.Semaphore | None) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + spec.arrival_time_s - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    state = _InFlight(start_s=time.perf_counter() - t0)
    url = api_root(config.base_url) + "/completions"
    try:
        await asyncio.wait_for(_stream_completion(client, url, request_body(spec, model, config), state, t0),
                               timeout=config.timeout_s)
    except asyncio.TimeoutError:
        state.error = f"timed out after {config.timeout_s:g} s"
    except httpx.HTTPError as exc:
        state.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if slots is not None:
            slots.release()
    end_s = time.perf_counter() - t0
    from_usage = state.usage_output_tokens is not None
    return RequestRecord(
        index=index, prompt_len=spec.prompt_len, target_output_len=spec.output_len,
        scheduled_s=spec.arrival_time_s, start_s=state.start_s, end_s=end_s,
        chunk_times_s=tuple(state.chunk_times_s), status_code=state.status_code, error=state.error,
        num_output_tokens=state.usage_output_tokens if from_usage else len(state.chunk_times_s),
        tokens_from_usage=from_usage,
    )


async def run_load(config: ClientConfig, specs: Sequence[RequestSpec],
                   concurrency: int | None = None, label: str = "bench") -> tuple[list[RequestRecord], float]:
    """Send every spec (at its arrival time, at most `concurrency` in flight when given); return the
    records in workload order and the run's wall time (s), from the start to the last request's end."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # httpx's default pool holds 100 connections: it would silently cap the offered load.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = config.model or await fetch_model_name(client, config.base_url)
        slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
        with tqdm(total=len(specs), desc=label, unit="req", disable=not config.show_progress, leave=False) as bar:
            t0 = time.perf_counter()
            tasks = [asyncio.ensure_future(_run_one(client, model, i, s, config, t0, slots))
                     for i, s in enumerate(specs)]
            for task in tasks:
                task.add_done_callback(lambda _: bar.update(1))
            records = await asyncio.gather(*tasks)
    wall_time_s = max((r.end_s for r in records), default=0.0)
    return list(records), wall_time_s


async def run_benchmark(base_url: str, specs: Sequence[RequestSpec], concurrency: int | None = None, *,
                        model: str | None = None, level: LoadLevel | None = None, slo: SLO | None = None,
                        ignore_eos: bool = True, temperature: float = 0.0, timeout_s: float = 600.0,
                        show_progress: bool = True, extra_body: dict[str, Any] | None = None) -> BenchResult:
    """Run one load level against `base_url` and summarize it. With every arrival at 0 and a
    `concurrency`, this is a closed loop of that many workers; otherwise requests are sent at their
    arrival times, `concurrency` (if given) capping how many are in flight. `level` only labels the
    result (inferred when None). Raises BenchClientError when the server cannot be reached."""
    config = ClientConfig(base_url=base_url, model=model, timeout_s=timeout_s, ignore_eos=ignore_eos,
                          temperature=temperature, extra_body=dict(extra_body or {}), show_progress=show_progress)
    if level is None:
        level = LoadLevel(concurrency=concurrency)
    # Everything alive now outlives the run: frozen, no full collection walks it, which would stall
    # this client for 50-250 ms mid-stream (with torch and earlier results in the heap) and read as
    # server latency.
    gc.freeze()
    records, wall_time_s = await run_load(config, specs, concurrency, level.label)
    return summarize_run(records, level, wall_time_s, slo)


def run_benchmark_sync(base_url: str, specs: Sequence[RequestSpec], concurrency: int | None = None,
                       **kwargs: Any) -> BenchResult:
    """`run_benchmark` for code that has no event loop running."""
    return asyncio.run(run_benchmark(base_url, specs, concurrency, **kwargs))
