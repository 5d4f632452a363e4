"""Fake replicas for the router's unit tests: an httpx.MockTransport answers for each replica url
by a script of behaviours (no processes, no sockets, no sleeps), and a FakeClock.

A behaviour maps the request body a replica receives to its response. Streams are completions
of `num_tokens` tokens: token i has id 100 + i and text "t{i} "; a resumed request starts at its
`resume_token_ids`, as a real replica does, so a resumed stream's text is the fault-free one.
"""
from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable

import httpx
import pytest

from shardserve.config import RouterConfig
from shardserve.router.forwarding import Forwarder
from shardserve.router.metrics import RouterMetrics
from shardserve.router.policies import make_policy
from shardserve.router.replica_pool import ReplicaPool
from shardserve.server.protocol import error_body

Behaviour = Callable[[dict], httpx.Response]


class FakeClock:
    def __init__(self, now_s: float = 1000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json=error_body(status, message))  # a replica's error shape


def answer(body: dict) -> httpx.Response:
    return httpx.Response(200, json={"id": "cmpl-0", "object": "text_completion", "created": 1, "choices": [
        {"index": 0, "text": "t0 ", "finish_reason": "length"}], "usage": {"completion_tokens": 1}})


def busy(body: dict) -> httpx.Response:
    return _error(429, "the replica is busy")


def broken(body: dict) -> httpx.Response:
    return _error(500, "the replica broke")


def client_error(body: dict) -> httpx.Response:
    return _error(400, "max_tokens must be at least 1")


def unreachable(body: dict) -> httpx.Response:
    raise httpx.ConnectError("connection refused")


def died_while_connecting(body: dict) -> httpx.Response:
    """What httpcore over anyio raised when a SIGKILLed replica closed a connection being set up."""
    raise AttributeError("'NoneType' object has no attribute 'getpeername'")


def hang(arrived: asyncio.Event) -> Behaviour:
    """Never answers; `arrived` is set once the request is on the replica."""
    async def respond(body: dict) -> httpx.Response:
        arrived.set()
        await asyncio.Event().wait()
    return respond


def held(release: asyncio.Event, then: Behaviour = answer) -> Behaviour:
    """Answers as `then` once `release` is set: the request stays in flight until the test says."""
    async def respond(body: dict) -> httpx.Response:
        await release.wait()
        return then(body)
    return respond


def stream(num_tokens: int = 6, break_at: int | None = None, garbage_at: int | None = None,
           name: str = "cmpl-a") -> Behaviour:
    """An SSE completion stream with id `name`; the connection breaks before token `break_at`,
    or a line that is not JSON comes instead of token `garbage_at`."""
    def respond(body: dict) -> httpx.Response:
        async def events():
            for i in range(len(body.get("resume_token_ids") or []), num_tokens):
                if i == break_at:
                    raise httpx.ReadError("connection lost")
                if i == garbage_at:
                    yield b"data: {not json\n\n"
                    return
                finish = "length" if i == num_tokens - 1 else None
                chunk = {"id": name, "object": "text_completion", "created": 7, "choices": [
                    {"index": 0, "text": f"t{i} ", "token_ids": [100 + i], "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
    return respond


class FakeReplicas:
    """Replicas by url: each request takes the next behaviour of its url's script (the last
    repeats). `received` lists (url, body) in arrival order."""

    def __init__(self, scripts: dict[str, Behaviour | list[Behaviour]]):
        self.scripts = {url: list(s) if isinstance(s, list) else [s] for url, s in scripts.items()}
        self.received: list[tuple[str, dict]] = []

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url, body = f"{request.url.scheme}://{request.url.host}", json.loads(request.content)
        self.received.append((url, body))
        script = self.scripts[url]
        response = (script.pop(0) if len(script) > 1 else script[0])(body)
        return await response if inspect.isawaitable(response) else response

    def urls_received(self) -> list[str]:
        return [url for url, _ in self.received]


def healthy_pool(config: RouterConfig) -> ReplicaPool:
    pool = ReplicaPool(list(config.replicas), config.eject_after_failures, config.eject_base_s, config.eject_max_s)
    for replica in pool.replicas.values():  # the start-up probe: every replica answers
        pool.record_success(replica)
    return pool


def make_forwarder(replicas: FakeReplicas, policy: str = "least_outstanding", clock: FakeClock | None = None,
                   **settings) -> Forwarder:
    """A Forwarder over `replicas`, all healthy. least_outstanding tries idle replicas in url order."""
    config = RouterConfig(replicas=tuple(replicas.scripts), policy=policy, **settings)
    return Forwarder(config, healthy_pool(config), make_policy(policy, config.prefix_chars, config.prefix_load_slack),
                     replicas.client(), RouterMetrics(policy), *([clock] if clock else []))


def in_flight(forwarder: Forwarder) -> dict[str, int]:
    return {url: r.outstanding for url, r in forwarder.pool.replicas.items()}


def metric(forwarder: Forwarder, name: str, **labels: str) -> float:
    return forwarder.metrics.registry.get_sample_value(name, labels) or 0.0


def cancel_while_on_first_replica(forwarder: Forwarder, start, arrived: asyncio.Event) -> None:
    """Start `start()` (a forwarding coroutine), wait until it sits on http://r0 (whose behaviour
    is `hang(arrived)`), then cancel it as a departing client's request is cancelled."""
    async def scenario():
        task = asyncio.ensure_future(start())
        await arrived.wait()
        assert in_flight(forwarder)["http://r0"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(scenario())
