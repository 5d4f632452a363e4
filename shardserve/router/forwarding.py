"""Sending one client request to replicas until it is answered.

    admit (admission.py: backpressure, request class) -> the retry loop (retry.py) -> send
      429 from the replica: busy, try another (not a failure)
      4xx: the client's error, passed through unchanged
      5xx, connection error, stall, replica ejected meanwhile: a failure; before the first byte
        retry elsewhere, mid-stream resume elsewhere (stream_relay.py); at most `max_attempts`

Every request to a replica holds a lease on it (lease.py) from its send to its end, whichever
way it ends; the request's class holds another (the interactive count that admission reads).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError, admit
from shardserve.router.lease import Lease
from shardserve.router.metrics import RouterMetrics
from shardserve.router.migration import StreamProgress
from shardserve.router.policies import RoutingPolicy
from shardserve.router.replica_pool import Replica, ReplicaPool, ReplicaState
from shardserve.router.retry import Attempt, Attempts, Outcome, ReplicaBusy, ReplicaFailed
from shardserve.router.stream_relay import StreamRelay, StreamRequest, Upstream
from shardserve.router.transport_errors import TRANSPORT_ERRORS

log = logging.getLogger(__name__)
T = TypeVar("T")


class Forwarder:
    def __init__(self, config: RouterConfig, pool: ReplicaPool, policy: RoutingPolicy, client: httpx.AsyncClient,
                 metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic):
        self.config, self.pool, self.policy, self.client, self.metrics = config, pool, policy, client, metrics
        self.clock = clock  # the streams' stall watchdogs and waits read it
        self.rng = random.Random()
        self.num_interactive = 0  # interactive requests in flight: batch work waits while there are any

    # --- admission ----------------------------------------------------------------------------------
    def admit(self, body: dict) -> None:
        """Raise RouterError 503 (no replica) or 429 (all saturated; batch work while interactive
        requests are in flight or beyond its share of the capacity): admission.admit's rules."""
        replicas = self.pool.routable()
        try:
            admit(self.config, len(replicas), sum(r.outstanding for r in replicas),
                  body.get("request_class") == "batch", self.num_interactive)
        except RouterError as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            raise

    def lease_interactive(self, body: dict) -> Lease | None:
        """An interactive request's place in `num_interactive`, until released; None for batch."""
        return None if body.get("request_class") == "batch" else Lease(self._count_interactive)

    def _count_interactive(self, delta: int) -> None:
        self.num_interactive += delta

    def prepare(self, body: dict) -> dict:
        """Seed sampled requests, so that a resumed stream continues with the same tokens."""
        if body.get("seed") is None and body.get("temperature", 1.0) != 0:
            body = dict(body, seed=self.rng.randrange(2**62))
        return body

    # --- the retry loop -----------------------------------------------------------------------------
    def attempts(self, prefix: str) -> Attempts:
        return Attempts(self.config, self.pool, self.policy, prefix)

    async def first_accepting(self, attempts: Attempts, send: Callable[[Replica], Awaitable[T]]) -> tuple[Attempt, T]:
        """The retry loop around HTTP (retry.first_accepting is the simulator's twin): `send` raises
        ReplicaBusy or ReplicaFailed, and `attempts` decides what that means and what comes next.
        The accepting attempt's lease is the caller's; every other is released here, also when
        the request is cancelled meanwhile."""
        while True:
            attempt = attempts.next()
            self.metrics.decisions.labels(self.metrics.policy, attempt.replica.url).inc()
            try:
                return attempt, await send(attempt.replica)
            except ReplicaBusy:
                attempts.settle(attempt, Outcome.BUSY)
            except ReplicaFailed as exc:
                self.failed(attempts, attempt, exc, retried=True)
            except BaseException:
                attempt.lease.release()
                raise

    def failed(self, attempts: Attempts, attempt: Attempt, reason: ReplicaFailed, retried: bool) -> None:
        """Settle a FAILED attempt: logged, counted as a retry (`retried`; a resumed stream counts
        as a migration instead) and against the replica's circuit breaker."""
        log.warning("request failed on %s (%s); trying another replica", attempt.replica.url, reason)
        if retried:
            self.metrics.retries.labels(attempt.replica.url).inc()
        attempts.settle(attempt, Outcome.FAILED)

    # --- non-streaming ------------------------------------------------------------------------------
    async def complete(self, path: str, body: dict, prefix: str, received_at: float) -> tuple[int, dict]:
        """(status, JSON body) of the first replica that answers; retried elsewhere on failure."""
        attempts = self.attempts(prefix)

        async def post(replica: Replica) -> tuple[int, dict]:
            if len(attempts.tried) == 1:
                self.metrics.added_latency.observe(time.monotonic() - received_at)
            return await self._post(replica, path, body)

        attempt, (status, answer) = await self.first_accepting(attempts, post)
        attempt.lease.release()  # answered: the request is no longer on the replica
        attempt.replica.last_data_at = time.monotonic()
        attempts.succeeded(attempt)
        self.metrics.requests.labels(attempt.replica.url, "ok" if status < 400 else "client_error").inc()
        return status, answer

    async def _post(self, replica: Replica, path: str, body: dict) -> tuple[int, dict]:
        try:
            response = await unless_lost(replica, self.client.post(
                f"{replica.url}{path}", json=body,
                timeout=httpx.Timeout(self.config.first_token_timeout_s, connect=self.config.probe_timeout_s)))
        except TRANSPORT_ERRORS as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
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
                          received_at: float) -> tuple[int, dict | StreamRelay]:
        """Find a replica that starts the stream: (200, the client's byte stream, which the caller
        must aclose()) or (status, error body) for a client error; RouterError when no replica
        could start it. The stream resumes elsewhere if its replica fails."""
        attempts, progress = self.attempts(prefix), StreamProgress.for_request(kind, body)
        upstream = await self.start_stream(attempts, path, progress.next_body(body))
        self.metrics.added_latency.observe(time.monotonic() - received_at)
        status = upstream.response.status_code
        if status == 200:
            relay = StreamRelay(self, attempts, StreamRequest(path, body, progress), upstream)
            try:
                await relay.open()  # up to the first token: a failure before it is still an HTTP status
            except BaseException:
                await relay.aclose()
                raise
            return 200, relay
        try:  # the client's mistake: the replica's answer as is
            answer = json.loads(await upstream.response.aread() or b"{}")
        finally:
            await upstream.close()
        self.metrics.requests.labels(upstream.attempt.replica.url, "client_error").inc()
        return status, answer

    async def start_stream(self, attempts: Attempts, path: str, body: dict) -> Upstream:
        """Send the stream request to the next replicas `attempts` gives until one answers with
        anything but 429 or 5xx; its lease is then held by the returned Upstream."""
        async def send(replica: Replica) -> httpx.Response:
            request = self.client.build_request("POST", f"{replica.url}{path}", json=body, timeout=httpx.Timeout(
                None, connect=self.config.probe_timeout_s))
            try:
                # a frozen replica still accepts connections: its headers are waited for only
                # until the health checks find it unresponsive or eject it
                response = await unless_lost(replica, self.client.send(request, stream=True))
            except TRANSPORT_ERRORS as exc:
                raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
            if response.status_code == 429 or response.status_code >= 500:
                await response.aclose()
                raise ReplicaBusy() if response.status_code == 429 else ReplicaFailed(f"HTTP {response.status_code}")
            return response

        attempt, response = await self.first_accepting(attempts, send)
        return Upstream(attempt, response)


async def unless_lost(replica: Replica, awaitable):
    """`awaitable`'s result, or ReplicaFailed as soon as the health checks eject `replica` or find
    it unresponsive (nothing sent, probe unanswered: frozen); the request has no answer yet, so
    it is retried elsewhere."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and (replica.state is ReplicaState.EJECTED or not replica.responsive):
                raise ReplicaFailed("replica ejected or unresponsive while the request was in flight")
        return task.result()
    finally:
        task.cancel()
