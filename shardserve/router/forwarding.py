"""Sending one client request to replicas until it is answered.

    admit (backpressure, request class) -> pick a replica (policy) -> send
      429 from the replica: busy, try another (not a failure)
      4xx: the client's error, passed through unchanged
      5xx, connection error, stall, replica ejected meanwhile: a failure; before the first byte
        retry elsewhere, mid-stream resume elsewhere (migration.py); at most `max_attempts`
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator

import httpx

from shardserve.config import RouterConfig
from shardserve.router.metrics import RouterMetrics
from shardserve.router.migration import StreamProgress, sse
from shardserve.router.policies import RoutingPolicy
from shardserve.router.replica_pool import Replica, ReplicaPool
from shardserve.server.protocol import error_body

log = logging.getLogger(__name__)


@dataclass
class RouterError(Exception):
    status: int
    message: str
    retry_after_s: int | None = None


class ReplicaFailed(Exception):
    """The replica broke the request (connection lost, 5xx, stall, ejected): try another."""


class ReplicaBusy(Exception):
    """The replica answered 429."""


class Forwarder:
    def __init__(self, config: RouterConfig, pool: ReplicaPool, policy: RoutingPolicy, client: httpx.AsyncClient,
                 metrics: RouterMetrics):
        self.config, self.pool, self.policy, self.client, self.metrics = config, pool, policy, client, metrics
        self.rng = random.Random()
        self.num_interactive = 0  # interactive requests in flight: batch work waits while there are any

    # --- admission and choice -----------------------------------------------------------------------
    def admit(self, body: dict) -> None:
        """Raise RouterError 503 (no replica) or 429 (all saturated; batch work while interactive
        requests are in flight or beyond its share of the capacity)."""
        replicas = self.pool.routable()
        if not replicas:
            self.metrics.rejected.labels("no_replica").inc()
            raise RouterError(503, "no replica is available", retry_after_s=1)
        capacity = self.config.max_outstanding_per_replica * len(replicas)
        in_flight = sum(r.outstanding for r in replicas)
        if in_flight >= capacity:
            self.metrics.rejected.labels("saturated").inc()
            raise RouterError(429, f"every replica is saturated ({in_flight} requests in flight); retry later", 1)
        if body.get("request_class") == "batch" and (
                self.num_interactive > 0 or in_flight >= self.config.batch_capacity_fraction * capacity):
            self.metrics.rejected.labels("batch_deferred").inc()
            raise RouterError(429, "batch requests are admitted only while the fleet has idle capacity", 5)

    def pick(self, prefix: str, tried: set[str]) -> Replica:
        candidates = [r for r in self.pool.routable(tried) if r.outstanding < self.config.max_outstanding_per_replica]
        if not candidates:
            raise RouterError(429 if self.pool.routable() else 503, "no replica can take the request now; retry later", 1)
        replica = self.policy.choose(candidates, prefix)
        self.metrics.decisions.labels(self.metrics.policy, replica.url).inc()
        return replica

    def prepare(self, body: dict) -> dict:
        """Seed sampled requests, so that a resumed stream continues with the same tokens."""
        if body.get("seed") is None and body.get("temperature", 1.0) != 0:
            body = dict(body, seed=self.rng.randrange(2**62))
        return body

    # --- non-streaming ------------------------------------------------------------------------------
    async def complete(self, path: str, body: dict, prefix: str, received_at: float) -> tuple[int, dict]:
        """(status, JSON body) of the first replica that answers; retried elsewhere on failure."""
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            replica = self.pick(prefix, tried)
            tried.add(replica.url)
            replica.outstanding += 1
            try:
                if attempt == 0:
                    self.metrics.added_latency.observe(time.monotonic() - received_at)
                status, answer = await self._post(replica, path, body)
            except ReplicaBusy:
                continue
            except ReplicaFailed as exc:
                self._failed(replica, exc, retried=True)
                continue
            finally:
                replica.outstanding -= 1
            replica.last_data_at = time.monotonic()
            self.pool.record_success(replica)
            self.metrics.requests.labels(replica.url, "ok" if status < 400 else "client_error").inc()
            return status, answer
        raise RouterError(503, f"the request failed on {len(tried)} replicas", retry_after_s=1)

    async def _post(self, replica: Replica, path: str, body: dict) -> tuple[int, dict]:
        task = asyncio.ensure_future(self.client.post(f"{replica.url}{path}", json=body, timeout=httpx.Timeout(
            self.config.first_token_timeout_s, connect=self.config.probe_timeout_s)))
        try:
            while not task.done():  # a replica ejected by the health checks is not waited for
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and replica.state == "ejected":
                    raise ReplicaFailed("replica ejected while the request was in flight")
            response = task.result()
        except httpx.HTTPError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            task.cancel()
        if response.status_code == 429:
            raise ReplicaBusy()
        if response.status_code >= 500:
            raise ReplicaFailed(f"HTTP {response.status_code}")
        try:
            return response.status_code, response.json()
        except ValueError:
            raise ReplicaFailed("the replica's answer is not JSON") from None

    # --- streaming ----------------------------------------------------------------------------------
    async def open_stream(self, kind: str, path: str, body: dict, prefix: str,
                          received_at: float) -> tuple[int, dict | AsyncIterator[bytes]]:
        """Find a replica that accepts the stream: (200, the client's byte stream) or (status,
        error body) for a client error. The stream resumes elsewhere if its replica fails."""
        progress = StreamProgress.for_request(kind, body)
        tried: set[str] = set()
        first = True
        while True:
            replica, response = await self._start(path, progress.next_body(body), prefix, tried)
            if first:
                self.metrics.added_latency.observe(time.monotonic() - received_at)
                first = False
            if response.status_code != 200:  # the client's mistake: the replica's answer as is
                answer = json.loads(await response.aread() or b"{}")
                await response.aclose()
                replica.outstanding -= 1
                self.metrics.requests.labels(replica.url, "client_error").inc()
                return response.status_code, answer
            return 200, self._relay(path, body, prefix, progress, tried, replica, response)

    async def _start(self, path: str, body: dict, prefix: str, tried: set[str]) -> tuple[Replica, httpx.Response]:
        """Send the stream request to a replica not yet tried; its outstanding count is raised."""
        while True:
            if len(tried) >= self.config.max_attempts:
                raise RouterError(503, f"the request failed on {len(tried)} replicas", retry_after_s=1)
            replica = self.pick(prefix, tried)
            tried.add(replica.url)
            replica.outstanding += 1
            request = self.client.build_request("POST", f"{replica.url}{path}", json=body, timeout=httpx.Timeout(
                None, connect=self.config.probe_timeout_s))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError as exc:
                replica.outstanding -= 1
                self._failed(replica, exc, retried=True)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                await response.aclose()
                replica.outstanding -= 1
                if response.status_code >= 500:
                    self._failed(replica, f"HTTP {response.status_code}", retried=True)
                continue
            return replica, response

    async def _relay(self, path: str, body: dict, prefix: str, progress: StreamProgress, tried: set[str],
                     replica: Replica, response: httpx.Response) -> AsyncIterator[bytes]:
        """Forward the replica's events; on failure continue on another replica."""
        try:
            while True:
                try:
                    async for event in self._events(replica, response, progress):
                        yield event
                    self.pool.record_success(replica)
                    self.metrics.requests.labels(replica.url, "ok").inc()
                    return
                except ReplicaFailed as exc:
                    self._failed(replica, exc, retried=not progress.token_ids)
                    if progress.token_ids:
                        self.metrics.migrations.labels(replica.url).inc()
                        if body.get("n", 1) != 1:
                            raise RouterError(503, "a stream with n > 1 cannot be resumed") from None
                    await response.aclose()
                    replica.outstanding -= 1
                    replica, response = None, None
                    replica, response = await self._start(path, progress.next_body(body), prefix, tried)
                    if response.status_code != 200:
                        raise RouterError(503, f"resuming on {replica.url} failed with HTTP {response.status_code}")
        except RouterError as exc:
            self.metrics.requests.labels(replica.url if replica else "none", "failed").inc()
            yield sse(error_body(exc.status, exc.message))
            yield sse("[DONE]")
        finally:
            if response is not None:
                await response.aclose()
                replica.outstanding -= 1

    async def _events(self, replica: Replica, response: httpx.Response, progress: StreamProgress) -> AsyncIterator[bytes]:
        """The replica's SSE events, recorded in `progress`; raises ReplicaFailed on a broken
        connection, a stall, an error event or the replica's ejection. A watchdog closes the
        response when the replica stalls or is ejected, so the read loop itself stays plain."""
        watchdog = StallWatchdog(replica, response, self.config.first_token_timeout_s)
        watch = asyncio.ensure_future(watchdog.run())
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    yield sse("[DONE]")
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ReplicaFailed(f"error event: {chunk['error'].get('message')}")
                watchdog.touch(self.config.stall_timeout_s)
                replica.last_data_at = watchdog.last_data_at
                yield sse(progress.observe(chunk))
            failure = "the stream ended without [DONE]"
        except (httpx.HTTPError, httpx.StreamError) as exc:  # StreamClosed: the watchdog closed it
            failure = f"the stream broke: {type(exc).__name__} {exc}"
        finally:
            watch.cancel()
        if watchdog.reason:
            failure = watchdog.reason
        if progress.finished and not watchdog.reason:  # every choice ended; only [DONE] was lost
            yield sse("[DONE]")
            return
        raise ReplicaFailed(failure)

    def _failed(self, replica: Replica, reason, retried: bool) -> None:
        log.warning("request failed on %s (%s); trying another replica", replica.url, reason)
        if retried:
            self.metrics.retries.labels(replica.url).inc()
        self.pool.record_failure(replica)


class StallWatchdog:
    """Closes a replica's response when no data came for `timeout_s`, or when the replica was
    ejected and this stream too has been silent for a second (a stream still flowing stays put);
    checked every 0.25 s. The reader then sees the stream end and moves the request on."""

    EJECTED_SILENCE_S = 1.0

    def __init__(self, replica: Replica, response: httpx.Response, timeout_s: float):
        self.replica, self.response = replica, response
        self.last_data_at = time.monotonic()
        self.deadline = self.last_data_at + timeout_s
        self.reason: str | None = None

    def touch(self, timeout_s: float) -> None:
        self.last_data_at = time.monotonic()
        self.deadline = self.last_data_at + timeout_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            silent_s = time.monotonic() - self.last_data_at
            if self.replica.state == "ejected" and silent_s >= self.EJECTED_SILENCE_S:
                self.reason = "replica ejected mid-stream"
            elif time.monotonic() > self.deadline:
                self.reason = "the replica stalled (no data within the stall timeout)"
            if self.reason:
                await self.response.aclose()
                return
