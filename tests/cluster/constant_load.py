"""Constant background load for cluster tests: `num_streams` clients, each sending streamed
completions back to back on a thread until stopped, recording every request's outcome.

A request succeeds only if it gets HTTP 200, no error event, a final chunk with
finish_reason "length" and the closing [DONE]; anything else is recorded as a failure with why."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Outcome:
    started_s: float
    finished_s: float
    error: str | None  # None: it succeeded


class ConstantLoad:
    def __init__(self, base_url: str, model: str, num_streams: int = 4, max_tokens: int = 24):
        self.base_url, self.model = base_url, model
        self.num_streams, self.max_tokens = num_streams, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def __enter__(self) -> "ConstantLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def num_ok(self, since_s: float = 0.0) -> int:
        return sum(o.error is None and o.started_s >= since_s for o in self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)) as client:
            await asyncio.gather(*(self._stream_loop(client, i) for i in range(self.num_streams)))

    async def _stream_loop(self, client: httpx.AsyncClient, index: int) -> None:
        num_sent = 0
        while not self._stop.is_set():
            started_s = time.monotonic()
            error = await self._one(client, f"Stream {index}, request {num_sent}: the quick brown fox")
            self.outcomes.append(Outcome(started_s, time.monotonic(), error))
            num_sent += 1

    async def _one(self, client: httpx.AsyncClient, prompt: str) -> str | None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        finish_reason, done = None, False
        try:
            async with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        return f"error event: {chunk['error']}"
                    for choice in chunk.get("choices") or []:
                        finish_reason = choice.get("finish_reason") or finish_reason
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if not done or finish_reason != "length":
            return f"incomplete stream: done={done} finish_reason={finish_reason}"
        return None
