"""A stream with nothing to send yet (queued, in a long prefill) gets a progress comment every
PROGRESS_INTERVAL_S while the engine makes progress, and none while it is stuck or dead: what the
router's stall watchdog goes by (tests/router/test_stream_relay.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shardserve.server.api import _sse
from shardserve.server.protocol import PROGRESS_COMMENT, PROGRESS_INTERVAL_S


class SilentStream:
    """A request whose engine has produced nothing for it yet."""

    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("progressing", [True, False], ids=["engine-running", "engine-stuck"])
def test_a_silent_stream_gets_progress_comments_only_while_the_engine_runs(progressing):
    engine = SimpleNamespace(making_progress=lambda stuck_after_s: progressing)
    call = SimpleNamespace(num_resumed_tokens=0, echo_prefixes=[""], builder=SimpleNamespace(kind="completion"))
    stream = SilentStream()

    async def first_two_events() -> list[str]:
        events = _sse(engine, call, [stream])
        try:
            return [await asyncio.wait_for(events.__anext__(), timeout=1.5 * PROGRESS_INTERVAL_S) for _ in range(2)]
        except TimeoutError:
            return []
        finally:
            await events.aclose()

    assert asyncio.run(first_two_events()) == ([PROGRESS_COMMENT] * 2 if progressing else [])
    assert stream.closed  # the client gone: the request is aborted
