"""Watching one replica stream for silence: the watchdog closes the replica's response when
nothing came for the stall timeout, or when the replica was ejected (by the health checks or
another request's failure) and this stream too has been silent for a second; a stream still
flowing stays put. The reader then sees the stream end and moves the request on
(stream_relay.py). "Nothing" means no event and no progress comment: a replica sends one every
second while its engine runs (protocol.PROGRESS_INTERVAL_S), also while the request waits in its
queue or in a long prefill, so silence means a dead, frozen or hung replica, not a busy one."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from shardserve.router.replica_pool import Replica, ReplicaState


class StallWatchdog:
    EJECTED_SILENCE_S = 1.0
    CHECK_INTERVAL_S = 0.25

    def __init__(self, replica: Replica, response: httpx.Response, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        """The stream may stay silent for `timeout_s` from now, and from each event or progress
        comment (touch)."""
        self.replica, self.response, self.clock, self.timeout_s = replica, response, clock, timeout_s
        self.reason: str | None = None
        self.touch()

    def touch(self) -> None:
        """Something came: the stream may now stay silent for the timeout."""
        self.last_data_at = self.clock()
        self.deadline = self.last_data_at + self.timeout_s

    def check(self) -> str | None:
        """Why the stream should be given up now, if it should (kept in `reason`)."""
        now = self.clock()
        if self.replica.state is ReplicaState.EJECTED and now - self.last_data_at >= self.EJECTED_SILENCE_S:
            self.reason = "replica ejected mid-stream"
        elif now > self.deadline:
            self.reason = "the replica stalled (no data within the stall timeout)"
        return self.reason

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.CHECK_INTERVAL_S)
            if self.check():
                await self.response.aclose()
                return
