"""Streams through the router against fake replicas: relayed, resumed elsewhere from the tokens
sent, and every replica lease released exactly once however the stream ends (finished, failed,
broken by an exception, the client gone mid-stream or before the first byte, cancelled while
starting). Only Forwarder.open_stream and the stream it returns are used."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.router.fake_replicas import (broken, busy, cancel_while_on_first_replica, client_error,
                                        died_while_connecting, FakeReplicas, hang, in_flight, make_forwarder, metric,
                                        stream, unreachable)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 6, "temperature": 0, "stream": True}
ALL_IDLE = {"http://r0": 0, "http://r1": 0, "http://r2": 0}


def payloads(events: list[bytes]) -> list:
    out = []
    for event in events:
        data = event.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text(events: list) -> str:
    return "".join(c["choices"][0]["text"] for c in events if isinstance(c, dict) and "choices" in c)


async def open_and_read(forwarder, body=BODY) -> list:
    status, relay = await forwarder.open_stream("completion", "/v1/completions", body, "", 0.0)
    assert status == 200
    try:
        return payloads([event async for event in relay])
    finally:
        await relay.aclose()


def test_a_stream_is_relayed_and_its_lease_released():
    replicas = FakeReplicas({"http://r0": stream(), "http://r1": stream(), "http://r2": stream()})
    forwarder = make_forwarder(replicas)
    events = asyncio.run(open_and_read(forwarder))
    assert text(events) == "t0 t1 t2 t3 t4 t5 " and events[-1] == "[DONE]"
    assert all("token_ids" not in c["choices"][0] for c in events[:-1])  # the client did not ask for them
    assert replicas.received[0][1]["return_token_ids"] is True  # the router did
    assert in_flight(forwarder) == ALL_IDLE


def test_a_broken_stream_resumes_on_another_replica_from_the_tokens_sent():
    replicas = FakeReplicas({"http://r0": stream(break_at=3, name="cmpl-first"),
                             "http://r1": stream(name="cmpl-second"), "http://r2": stream()})
    forwarder = make_forwarder(replicas)
    events = asyncio.run(open_and_read(forwarder))
    assert text(events) == "t0 t1 t2 t3 t4 t5 "  # no gap, no repeat
    assert {c["id"] for c in events[:-1]} == {"cmpl-first"}  # the first replica's id throughout
    (url0, _), (url1, resume) = replicas.received
    assert (url0, url1) == ("http://r0", "http://r1")
    assert resume["resume_token_ids"] == [100, 101, 102] and resume["resume_text_chars"] == len("t0 t1 t2 ")
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 1
    assert metric(forwarder, "shardserve_router_migrations_total", replica="http://r0") == 1
    assert in_flight(forwarder) == ALL_IDLE


@pytest.mark.parametrize("failure", [broken, died_while_connecting])
def test_busy_replicas_are_skipped_and_failed_ones_counted_before_the_first_byte(failure):
    replicas = FakeReplicas({"http://r0": busy, "http://r1": failure, "http://r2": stream()})
    forwarder = make_forwarder(replicas)
    assert text(asyncio.run(open_and_read(forwarder))) == "t0 t1 t2 t3 t4 t5 "
    assert replicas.urls_received() == ["http://r0", "http://r1", "http://r2"]
    failures = {url: r.consecutive_failures for url, r in forwarder.pool.replicas.items()}
    assert failures == {"http://r0": 0, "http://r1": 1, "http://r2": 0}  # a 429 is not a failure
    assert in_flight(forwarder) == ALL_IDLE


def test_a_client_error_is_passed_through_and_releases_the_lease():
    forwarder = make_forwarder(FakeReplicas({"http://r0": client_error, "http://r1": stream(), "http://r2": stream()}))
    status, answer = asyncio.run(forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0))
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert in_flight(forwarder) == ALL_IDLE


def test_no_replica_left_mid_stream_ends_with_an_error_event():
    replicas = FakeReplicas({"http://r0": stream(break_at=2), "http://r1": unreachable, "http://r2": stream()})
    forwarder = make_forwarder(replicas, max_attempts=2)
    events = asyncio.run(open_and_read(forwarder))
    assert text(events) == "t0 t1 "
    assert events[-2]["error"]["type"] == "service_unavailable" and events[-1] == "[DONE]"
    assert replicas.urls_received() == ["http://r0", "http://r1"]  # max_attempts counts the resume
    assert in_flight(forwarder) == ALL_IDLE


@pytest.mark.parametrize("extra", [dict(n=2), dict(tools=[{"type": "function", "function": {"name": "f"}}])],
                         ids=["n=2", "tools"])
def test_streams_with_n_above_1_or_tools_are_not_resumed(extra):
    replicas = FakeReplicas({"http://r0": stream(break_at=2), "http://r1": stream(), "http://r2": stream()})
    forwarder = make_forwarder(replicas)
    events = asyncio.run(open_and_read(forwarder, dict(BODY, **extra)))
    assert "cannot be resumed" in events[-2]["error"]["message"] and len(replicas.received) == 1
    assert in_flight(forwarder) == ALL_IDLE


def test_an_exception_mid_stream_releases_the_lease_once():
    forwarder = make_forwarder(FakeReplicas({"http://r0": stream(garbage_at=2), "http://r1": stream(),
                                             "http://r2": stream()}))

    async def scenario():
        status, relay = await forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0)
        with pytest.raises(ValueError):  # the replica's line is not JSON
            async for _ in relay:
                pass
        await relay.aclose()  # as the response does when the stream ends: no second release
    asyncio.run(scenario())
    assert in_flight(forwarder) == ALL_IDLE


def test_the_client_gone_mid_stream_releases_the_lease_and_blames_no_replica():
    forwarder = make_forwarder(FakeReplicas({"http://r0": stream(), "http://r1": stream(), "http://r2": stream()}))

    async def scenario():
        status, relay = await forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0)
        events = aiter(relay)
        await anext(events)
        await anext(events)
        assert in_flight(forwarder)["http://r0"] == 1
        await relay.aclose()
    asyncio.run(scenario())
    assert in_flight(forwarder) == ALL_IDLE
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 0


def test_the_client_gone_before_the_first_byte_releases_the_lease():
    """The response closes a stream nobody read (the old relay, a generator, kept its lease)."""
    forwarder = make_forwarder(FakeReplicas({"http://r0": stream(), "http://r1": stream(), "http://r2": stream()}))

    async def scenario():
        status, relay = await forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0)
        assert in_flight(forwarder)["http://r0"] == 1
        await relay.aclose()
    asyncio.run(scenario())
    assert in_flight(forwarder) == ALL_IDLE


def test_a_stream_start_cancelled_while_waiting_for_the_replica_releases_the_lease():
    """The client's request cancelled before the replica answered (the old start kept its lease)."""
    arrived = asyncio.Event()
    forwarder = make_forwarder(FakeReplicas({"http://r0": hang(arrived), "http://r1": stream(), "http://r2": stream()}))
    cancel_while_on_first_replica(forwarder, lambda: forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0), arrived)
    assert in_flight(forwarder) == ALL_IDLE


def test_a_stream_start_on_a_replica_ejected_while_waiting_for_its_headers_goes_elsewhere():
    """A frozen replica accepts the connection and never answers: once the health checks eject
    it, the start moves on to the next replica instead of waiting for ever."""
    arrived = asyncio.Event()
    forwarder = make_forwarder(FakeReplicas({"http://r0": hang(arrived), "http://r1": stream(), "http://r2": stream()}))

    async def scenario() -> list:
        reading = asyncio.ensure_future(open_and_read(forwarder))
        await arrived.wait()
        forwarder.pool.eject(forwarder.pool.replicas["http://r0"])  # what the probes do to a frozen replica
        return await asyncio.wait_for(reading, timeout=10)

    events = asyncio.run(scenario())
    assert text(events) == "t0 t1 t2 t3 t4 t5 " and events[-1] == "[DONE]"
    assert in_flight(forwarder) == ALL_IDLE
