"""The router's app in process (httpx.ASGITransport) over fake replicas: request classes from the
X-Request-Class header, 429 with Retry-After for batch work while interactive work is in flight,
/admin/status, and a streamed response that releases its leases however it ends."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.requests import ClientDisconnect

from shardserve.config import RouterConfig
from shardserve.router.app import EventStreamResponse, build_router_app
from shardserve.router.replica_pool import ReplicaState
from tests.router.fake_replicas import FakeReplicas, held, in_flight, stream

BODY = {"model": "m", "prompt": "hello", "max_tokens": 6, "temperature": 0}


def router_over(replicas: FakeReplicas, **settings):
    """The app, its Router state, and the replicas healthy (as the start-up probe makes them)."""
    app, router = build_router_app(RouterConfig(replicas=tuple(replicas.scripts), **settings))
    router.forwarder.client = replicas.client()
    for replica in router.pool.replicas.values():
        router.pool.record_success(replica)
    return app, router


async def until(condition, max_turns: int = 1000) -> None:
    """Let the other tasks run until `condition()` holds (turns of the event loop, not time)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_batch_requests_get_429_with_retry_after_while_interactive_ones_are_in_flight():
    release = asyncio.Event()
    replicas = FakeReplicas({"http://r0": held(release)})
    app, router = router_over(replicas, max_outstanding_per_replica=4)
    batch_headers = {"X-Request-Class": "batch"}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            interactive = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(2)]
            await until(lambda: len(replicas.received) == 2)  # both are on the replica, unanswered
            deferred = await client.post("/v1/completions", json=BODY, headers=batch_headers)
            assert deferred.status_code == 429 and deferred.headers["retry-after"] == "5"
            assert deferred.json()["error"]["code"] == "rate_limit_exceeded" and len(replicas.received) == 2
            release.set()
            assert [r.status_code for r in await asyncio.gather(*interactive)] == [200, 200]
            assert router.forwarder.num_interactive == 0
            admitted = await client.post("/v1/completions", json=BODY, headers=batch_headers)
            assert admitted.status_code == 200 and replicas.received[-1][1]["request_class"] == "batch"
            status = (await client.get("/admin/status")).json()
            assert status["replicas"][0]["state"] == "healthy" and status["replicas"][0]["outstanding"] == 0
    asyncio.run(scenario())


def test_interactive_requests_reach_the_replica_at_once_beside_a_batch_backlog():
    release = asyncio.Event()
    replicas = FakeReplicas({"http://r0": held(release)})
    app, router = router_over(replicas, max_outstanding_per_replica=4)  # batch may hold 2 of the 4

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            batch = [asyncio.ensure_future(client.post("/v1/completions", json=dict(BODY, request_class="batch")))
                     for _ in range(2)]
            await until(lambda: len(replicas.received) == 2)
            over_share = await client.post("/v1/completions", json=dict(BODY, request_class="batch"))
            assert over_share.status_code == 429
            interactive = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(2)]
            await until(lambda: len(replicas.received) == 4)  # sent while the batch work is unanswered
            release.set()
            codes = [r.status_code for r in await asyncio.gather(*batch, *interactive)]
            assert codes == [200] * 4 and in_flight(router.forwarder) == {"http://r0": 0}
    asyncio.run(scenario())


async def open_response(router) -> EventStreamResponse:
    forwarder = router.forwarder
    body = dict(BODY, stream=True)
    interactive = forwarder.lease_interactive(body)
    status, relay = await forwarder.open_stream("completion", "/v1/completions", body, "", 0.0)
    assert status == 200 and forwarder.num_interactive == 1 and in_flight(forwarder) == {"http://r0": 1}
    return EventStreamResponse(relay, interactive)


def test_a_streamed_response_releases_its_leases_when_the_client_is_gone_before_the_first_byte():
    app, router = router_over(FakeReplicas({"http://r0": stream()}))

    async def gone(message):
        raise OSError("the client closed the connection")

    async def scenario():
        response = await open_response(router)
        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, None, gone)
    asyncio.run(scenario())
    assert router.forwarder.num_interactive == 0 and in_flight(router.forwarder) == {"http://r0": 0}
    assert router.pool.replicas["http://r0"].state is ReplicaState.HEALTHY


def test_a_streamed_response_sent_in_full_releases_its_leases():
    app, router = router_over(FakeReplicas({"http://r0": stream()}))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def scenario():
        response = await open_response(router)
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
    asyncio.run(scenario())
    body = b"".join(m.get("body", b"") for m in sent).decode()
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in body.split("\n\n") if line.startswith("data: {")]
    assert "".join(texts) == "t0 t1 t2 t3 t4 t5 " and body.endswith("data: [DONE]\n\n")
    assert router.forwarder.num_interactive == 0 and in_flight(router.forwarder) == {"http://r0": 0}


def test_a_sampled_stream_without_a_seed_resumes_elsewhere_with_the_seed_it_started_with():
    """The router seeds a sampled request that has none, so that the replica which resumes it
    samples the rest exactly as the first would have (a seeded token is a function of seed and
    position): the resume must carry the first attempt's seed."""
    replicas = FakeReplicas({"http://r0": stream(break_at=3), "http://r1": stream()})
    app, _ = router_over(replicas)
    body = dict(BODY, temperature=0.8, stream=True)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post("/v1/completions", json=body)
    answer = asyncio.run(scenario())
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in answer.text.split("\n\n") if line.startswith("data: {")]
    assert "".join(texts) == "t0 t1 t2 t3 t4 t5 "
    (url0, first), (url1, resume) = replicas.received
    assert (url0, url1) == ("http://r0", "http://r1") and resume["resume_token_ids"] == [100, 101, 102]
    assert isinstance(first["seed"], int) and resume["seed"] == first["seed"]
    assert "seed" not in body  # the client's body is left as it was


def test_a_model_is_retrieved_by_id_across_the_fleet():
    replicas = FakeReplicas({"http://r0": held(asyncio.Event()), "http://r1": held(asyncio.Event())})
    app, router = router_over(replicas)
    for replica in router.pool.replicas.values():
        replica.info = {"id": "org/model", "object": "model"}  # what the probes read from /v1/models

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            card = (await client.get("/v1/models/org/model")).json()
            assert card["id"] == "org/model" and [r["url"] for r in card["replicas"]] == ["http://r0", "http://r1"]
            missing = await client.get("/v1/models/other")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"

    asyncio.run(scenario())


def test_tokenize_and_detokenize_go_to_a_replica_as_they_are():
    def tokens(body: dict) -> httpx.Response:
        return httpx.Response(200, json={"count": 2, "tokens": [7, 8], "echo": body})

    replicas = FakeReplicas({"http://r0": tokens})
    app, _ = router_over(replicas)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [7, 8]})):
                reply = await client.post(route, json=body)
                assert reply.status_code == 200 and reply.json()["echo"] == body  # no seed or class added

    asyncio.run(scenario())
    assert len(replicas.received) == 2


def test_a_body_that_is_not_a_json_object_is_a_400_on_every_forwarded_route():
    replicas = FakeReplicas({"http://r0": held(asyncio.Event())})
    app, _ = router_over(replicas)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
                for body, message in ((b"nope", "not valid JSON"), (b"[1]", "a JSON object")):
                    reply = await client.post(route, content=body)
                    assert reply.status_code == 400 and message in reply.json()["error"]["message"]

    asyncio.run(scenario())
    assert replicas.received == []
