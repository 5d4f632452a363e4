"""StallWatchdog's verdicts on a fake clock: the stall timeout from the start and after each
event or progress comment, and an ejected replica's silent stream; run() closes the response on a
verdict."""
from __future__ import annotations

import asyncio

from shardserve.router.replica_pool import Replica, ReplicaState
from shardserve.router.stall_watchdog import StallWatchdog
from tests.router.fake_replicas import FakeClock


class FakeResponse:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


def watchdog(timeout_s: float = 10.0) -> tuple[StallWatchdog, Replica, FakeClock]:
    replica, clock = Replica("http://r0"), FakeClock()
    return StallWatchdog(replica, FakeResponse(), timeout_s, clock), replica, clock


def test_the_timeout_counts_from_the_start():
    dog, _, clock = watchdog(120.0)
    clock.advance(120.0)
    assert dog.check() is None
    clock.advance(0.01)
    assert "stalled" in dog.check()


def test_each_chunk_allows_the_stall_timeout_from_then():
    dog, _, clock = watchdog(10.0)
    clock.advance(5.0)
    dog.touch()
    clock.advance(10.0)
    assert dog.check() is None and dog.last_data_at == 1005.0
    clock.advance(0.01)
    assert "stalled" in dog.check()


def test_an_ejected_replicas_stream_is_given_up_after_a_second_of_silence_only():
    dog, replica, clock = watchdog()
    replica.state = ReplicaState.EJECTED
    clock.advance(0.9)
    assert dog.check() is None  # still flowing: it stays put
    dog.touch()
    clock.advance(0.99)
    assert dog.check() is None
    clock.advance(0.01)
    assert dog.check() == "replica ejected mid-stream"


def test_run_closes_the_response_once_a_verdict_is_reached():
    dog, _, clock = watchdog(1.0)
    dog.CHECK_INTERVAL_S = 0.0  # no waiting: the verdict is the clock's
    clock.advance(2.0)
    asyncio.run(asyncio.wait_for(dog.run(), timeout=5))
    assert dog.response.closed and "stalled" in dog.reason
