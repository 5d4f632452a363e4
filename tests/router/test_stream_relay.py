"""Streams through the router against fake replicas: relayed, resumed elsewhere from the tokens
sent (waiting for room when the others are busy), kept while the replica sends progress, a
failure before the first token answered as an HTTP status, one role chunk per chat choice, and
every replica lease released exactly once however the stream ends (finished, failed, broken by
an exception, the client gone mid-stream or before the first byte, cancelled while starting).
Only Forwarder.open_stream and the stream it returns are used."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from shardserve.router.admission import RouterError
from shardserve.server.protocol import PROGRESS_COMMENT
from tests.router.fake_replicas import (Behaviour, broken, busy, cancel_while_on_first_replica, client_error,
                                        died_while_connecting, FakeClock, FakeReplicas, hang, in_flight,
                                        make_forwarder, metric, stream, unreachable)

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


def _sse_response(events) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)


class ClosableEvents(httpx.AsyncByteStream):
    """A response body that, like a socket, breaks once the router closes the response."""

    def __init__(self, events):
        self.events, self.closed = events, False

    def __aiter__(self):
        return self.events(self)

    async def aclose(self) -> None:
        self.closed = True


def waits_then_streams(clock: FakeClock, waits: int, wait_s: float, progress: bool) -> Behaviour:
    """A replica that keeps the request queued `waits` times `wait_s` seconds of the fake clock
    (each let the watchdog look), sending its progress comment after each when `progress`."""
    def respond(body: dict) -> httpx.Response:
        async def events(body_stream: ClosableEvents):
            for _ in range(waits):
                clock.advance(wait_s)
                await asyncio.sleep(0.3)  # the watchdog checks every 0.25 s
                if body_stream.closed:
                    raise httpx.ReadError("closed by the router")
                if progress:
                    yield PROGRESS_COMMENT.encode()
            async for event in stream(num_tokens=3)(body).stream:
                yield event
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=ClosableEvents(events))
    return respond


@pytest.mark.parametrize("progress", [True, False], ids=["progress-comments", "silent"])
def test_a_queued_stream_stays_while_its_replica_sends_progress_and_moves_once_silent(progress):
    """Four waits of 6 s each (24 s before the first token, stall timeout 10 s): with the
    replica's progress comments the stream stays; a replica silent for 12 s has stalled."""
    clock = FakeClock()
    replicas = FakeReplicas({"http://r0": waits_then_streams(clock, 4 if progress else 1, 6.0 if progress else 12.0,
                                                             progress),
                             "http://r1": stream(num_tokens=3), "http://r2": stream(num_tokens=3)})
    forwarder = make_forwarder(replicas, clock=clock, stall_timeout_s=10.0)
    events = asyncio.run(open_and_read(forwarder))
    assert text(events) == "t0 t1 t2 " and events[-1] == "[DONE]"
    assert replicas.urls_received() == (["http://r0"] if progress else ["http://r0", "http://r1"])
    assert in_flight(forwarder) == ALL_IDLE


def test_no_replica_to_start_a_stream_is_an_http_status_not_an_error_after_200():
    """The first replica fails before the first token and the others are busy: the client gets
    429 as the answer's status (Retry-After), never a 200 followed by an error event."""
    forwarder = make_forwarder(FakeReplicas({"http://r0": stream(break_at=0), "http://r1": busy, "http://r2": busy}))
    with pytest.raises(RouterError) as refused:
        asyncio.run(forwarder.open_stream("completion", "/v1/completions", BODY, "", 0.0))
    assert refused.value.status == 429 and refused.value.retry_after_s
    assert in_flight(forwarder) == ALL_IDLE


def chat_stream(break_after_role: bool) -> Behaviour:
    """A chat stream: the role chunk, then (unless it breaks) two tokens."""
    def respond(body: dict) -> httpx.Response:
        async def events():
            def chunk(delta: dict, ids: list[int], finish: str | None = None) -> bytes:
                choice = {"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish}
                return f"data: {json.dumps({'id': 'chat-a', 'created': 7, 'choices': [choice]})}\n\n".encode()
            yield chunk({"role": "assistant", "content": ""}, [])
            if break_after_role:
                raise httpx.ReadError("connection lost")
            yield chunk({"content": "a"}, [100])
            yield chunk({"content": "b"}, [101], "length")
            yield b"data: [DONE]\n\n"
        return _sse_response(events())
    return respond


def test_a_chat_stream_retried_before_its_first_token_sends_one_role_chunk():
    forwarder = make_forwarder(FakeReplicas({"http://r0": chat_stream(break_after_role=True),
                                             "http://r1": chat_stream(False), "http://r2": chat_stream(False)}))

    async def read() -> list:
        status, relay = await forwarder.open_stream("chat", "/v1/chat/completions", BODY, "", 0.0)
        try:
            return payloads([event async for event in relay])
        finally:
            await relay.aclose()
    events = asyncio.run(read())
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict)]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert in_flight(forwarder) == ALL_IDLE


def test_a_resume_while_every_other_replica_is_busy_waits_for_room():
    """Mid-stream, the others answer 429: the stream waits (Retry-After) and resumes, no error."""
    replicas = FakeReplicas({"http://r0": stream(break_at=2), "http://r1": [busy, stream()], "http://r2": busy})
    forwarder = make_forwarder(replicas)
    events = asyncio.run(open_and_read(forwarder))
    assert text(events) == "t0 t1 t2 t3 t4 t5 " and events[-1] == "[DONE]"
    assert replicas.urls_received() == ["http://r0", "http://r1", "http://r2", "http://r1"]
    assert in_flight(forwarder) == ALL_IDLE
