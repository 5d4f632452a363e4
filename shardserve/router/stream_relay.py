"""Relaying one streamed request from its replica to the client, and resuming it on another
replica when that one fails.

    Forwarder.open_stream: the first replica that accepts (retry.py) -> StreamRelay
    open():  events read up to the first token, before the client gets its 200: a failure
      before it is retried on another replica, and when none can take the request the client
      gets the router's 429 / 503 as its HTTP status, not an error after a 200
    relay:   the replica's SSE events, each recorded in StreamProgress (migration.py), then [DONE]
      fails mid-stream (broken connection, stall, error event, ejected): its attempt settles
      FAILED and the request goes on on the next replica the same Attempts gives, resumed from
      the tokens the client has (n > 1 streams cannot resume: an error event ends them); while
      every other replica is busy it waits for room (up to first_token_timeout_s)
      no replica left: an error event and [DONE] (the client already has a 200)

The relay holds one Upstream at a time: a replica's response and the lease on that replica.
`aclose()` releases it however the stream ends, also when the client left before reading the
first byte (a generator never started never runs its own `finally`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from shardserve.router.admission import RouterError
from shardserve.router.migration import StreamProgress, not_resumable, sse
from shardserve.router.retry import Attempt, Attempts, ReplicaFailed
from shardserve.router.stall_watchdog import StallWatchdog
from shardserve.router.transport_errors import TRANSPORT_ERRORS
from shardserve.server.protocol import error_body

if TYPE_CHECKING:
    from shardserve.router.forwarding import Forwarder


@dataclass
class Upstream:
    """One replica's streamed response to the request, and the lease held on the replica meanwhile."""

    attempt: Attempt
    response: httpx.Response

    async def close(self) -> None:
        self.attempt.lease.release()  # first: a close cut short must not keep the replica busy
        await self.response.aclose()


@dataclass(frozen=True)
class StreamRequest:
    """What a resume needs: the endpoint, the client's request and what the client has received."""

    path: str
    body: dict
    progress: StreamProgress


class StreamRelay:
    """The client's byte stream (an async iterable of SSE events) for one streamed request."""

    def __init__(self, forwarder: Forwarder, attempts: Attempts, request: StreamRequest, upstream: Upstream):
        self.forwarder, self.attempts, self.request = forwarder, attempts, request
        self.upstream: Upstream | None = upstream
        self._events = self._relay()
        self._head: list[bytes] = []  # read by open(), not yet sent to the client
        self.opened = False  # the client has its 200: errors now go in the stream

    async def open(self) -> None:
        """Read the events up to the first token (or the end). Raises RouterError when no replica
        could start the stream: the caller answers it as the HTTP status."""
        progress = self.request.progress
        async for event in self._events:
            self._head.append(event)
            if progress.token_ids or progress.finished:
                break
        self.opened = True

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._client_events()

    async def _client_events(self) -> AsyncIterator[bytes]:
        head, self._head = self._head, []
        for event in head:
            yield event
        async for event in self._events:
            yield event

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._close_upstream()

    async def _close_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()

    async def _relay(self) -> AsyncIterator[bytes]:
        metrics = self.forwarder.metrics
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._replica_events(self.upstream)) as events:
                        async for event in events:  # aclosing: the client gone stops the watchdog now
                            yield event
                except ReplicaFailed as exc:
                    await self._resume(exc)
                    continue
                self.attempts.succeeded(self.upstream.attempt)
                metrics.requests.labels(self.upstream.attempt.replica.url, "ok").inc()
                return
        except RouterError as exc:
            metrics.requests.labels(self.upstream.attempt.replica.url if self.upstream else "none", "failed").inc()
            if not self.opened:
                raise  # the client gets it as the answer's status
            yield sse(error_body(exc.status, exc.message))
            yield sse("[DONE]")
        finally:
            await self._close_upstream()

    async def _resume(self, failure: ReplicaFailed) -> None:
        """Settle the failed attempt; continue on the next replica from the tokens sent so far."""
        progress, failed = self.request.progress, self.upstream
        mid_stream = bool(progress.token_ids)
        self.forwarder.failed(self.attempts, failed.attempt, failure, retried=not mid_stream)
        if mid_stream:
            self.forwarder.metrics.migrations.labels(failed.attempt.replica.url).inc()
            reason = not_resumable(self.request.body)
            if reason is not None:
                raise RouterError(503, reason)
        await self._close_upstream()
        clock = self.forwarder.clock
        wait_until = clock() + self.forwarder.config.first_token_timeout_s
        while True:
            try:
                self.upstream = await self.forwarder.start_stream(self.attempts, self.request.path,
                                                                  progress.next_body(self.request.body))
                break
            except RouterError as exc:
                # mid-stream, every other replica busy: wait for room rather than fail the client
                if not (mid_stream and exc.status == 429 and clock() < wait_until):
                    raise
                await asyncio.sleep(exc.retry_after_s or 1)
                self.attempts.forget_busy()
        status = self.upstream.response.status_code
        if status != 200:
            raise RouterError(503, f"resuming on {self.upstream.attempt.replica.url} failed with HTTP {status}")

    async def _replica_events(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """The replica's SSE events, recorded in the progress; raises ReplicaFailed on a broken
        connection, a stall, an error event or the replica's ejection. A watchdog closes the
        response when the replica stalls or is ejected, so the read loop itself stays plain."""
        config, progress = self.forwarder.config, self.request.progress
        replica, response = upstream.attempt.replica, upstream.response
        watchdog = StallWatchdog(replica, response, config.stall_timeout_s, self.forwarder.clock)
        watch = asyncio.ensure_future(watchdog.run())
        try:
            async for line in response.aiter_lines():
                if not line:
                    continue
                watchdog.touch()  # an event or the replica's progress comment
                replica.last_data_at = watchdog.last_data_at
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    yield sse("[DONE]")
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ReplicaFailed(f"error event: {chunk['error'].get('message')}")
                chunk = progress.observe(chunk)
                if chunk is not None:
                    yield sse(chunk)
            failure = "the stream ended without [DONE]"
        except (*TRANSPORT_ERRORS, httpx.StreamError) as exc:  # StreamClosed: the watchdog closed it
            failure = f"the stream broke: {type(exc).__name__} {exc}"
        finally:
            watch.cancel()
        if watchdog.reason:
            failure = watchdog.reason
        if progress.finished and not watchdog.reason:  # every choice ended; only [DONE] was lost
            yield sse("[DONE]")
            return
        raise ReplicaFailed(failure)
