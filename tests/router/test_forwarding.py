"""Non-streamed requests through the Forwarder against fake replicas: the retry loop's outcomes
over HTTP (429 busy, 5xx and connection errors failures, 4xx the client's), max_attempts, and the
replica lease released on every path, cancellation included."""
from __future__ import annotations

import asyncio

import pytest

from shardserve.router.admission import RouterError
from shardserve.router.replica_pool import ReplicaState
from tests.router.fake_replicas import (answer, broken, busy, cancel_while_on_first_replica, client_error,
                                        died_while_connecting, FakeReplicas, hang, in_flight, make_forwarder, metric,
                                        unreachable)

BODY = {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0}
ALL_IDLE = {"http://r0": 0, "http://r1": 0, "http://r2": 0}


def complete(forwarder, body=BODY):
    return asyncio.run(forwarder.complete("/v1/completions", body, "", 0.0))


def test_a_busy_replica_is_skipped_without_a_failure():
    replicas = FakeReplicas({"http://r0": busy, "http://r1": answer, "http://r2": answer})
    forwarder = make_forwarder(replicas)
    status, body = complete(forwarder)
    assert status == 200 and body["choices"][0]["text"] == "t0 "
    assert replicas.urls_received() == ["http://r0", "http://r1"]
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 0
    assert metric(forwarder, "shardserve_router_retries_total", replica="http://r0") == 0
    assert in_flight(forwarder) == ALL_IDLE


def test_failures_are_retried_elsewhere_and_eject_after_n():
    replicas = FakeReplicas({"http://r0": broken, "http://r1": unreachable, "http://r2": answer})
    forwarder = make_forwarder(replicas, eject_after_failures=2)
    assert complete(forwarder)[0] == 200
    assert replicas.urls_received() == ["http://r0", "http://r1", "http://r2"]
    assert metric(forwarder, "shardserve_router_retries_total", replica="http://r0") == 1
    assert complete(forwarder)[0] == 200
    states = {url: r.state for url, r in forwarder.pool.replicas.items()}
    assert states == {"http://r0": "ejected", "http://r1": "ejected", "http://r2": "healthy"}
    assert complete(forwarder)[0] == 200 and replicas.urls_received()[-1] == "http://r2"
    assert in_flight(forwarder) == ALL_IDLE


def test_a_replica_dying_while_the_connection_is_set_up_is_a_failure_retried_elsewhere():
    replicas = FakeReplicas({"http://r0": died_while_connecting, "http://r1": answer, "http://r2": answer})
    forwarder = make_forwarder(replicas)
    assert complete(forwarder)[0] == 200 and replicas.urls_received() == ["http://r0", "http://r1"]
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 1
    assert in_flight(forwarder) == ALL_IDLE


def test_max_attempts_failures_give_503():
    replicas = FakeReplicas({"http://r0": broken, "http://r1": broken, "http://r2": answer})
    forwarder = make_forwarder(replicas, max_attempts=2)
    with pytest.raises(RouterError) as refused:
        complete(forwarder)
    assert refused.value.status == 503 and refused.value.message == "the request failed on 2 replicas"
    assert len(replicas.received) == 2 and in_flight(forwarder) == ALL_IDLE


def test_every_replica_busy_gives_429():
    forwarder = make_forwarder(FakeReplicas({"http://r0": busy, "http://r1": busy, "http://r2": busy}))
    with pytest.raises(RouterError) as refused:
        complete(forwarder)
    assert refused.value.status == 429 and refused.value.retry_after_s == 1
    assert all(r.state is ReplicaState.HEALTHY for r in forwarder.pool.replicas.values())
    assert in_flight(forwarder) == ALL_IDLE


def test_a_client_error_is_the_answer_and_no_failure():
    replicas = FakeReplicas({"http://r0": client_error, "http://r1": answer, "http://r2": answer})
    forwarder = make_forwarder(replicas)
    forwarder.pool.replicas["http://r0"].consecutive_failures = 1
    status, body = complete(forwarder)
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and len(replicas.received) == 1
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 0  # it answered
    assert metric(forwarder, "shardserve_router_requests_total", replica="http://r0", outcome="client_error") == 1
    assert in_flight(forwarder) == ALL_IDLE


def test_a_request_cancelled_while_on_a_replica_releases_the_lease():
    arrived = asyncio.Event()
    forwarder = make_forwarder(FakeReplicas({"http://r0": hang(arrived), "http://r1": answer, "http://r2": answer}))
    cancel_while_on_first_replica(forwarder, lambda: forwarder.complete("/v1/completions", BODY, "", 0.0), arrived)
    assert in_flight(forwarder) == ALL_IDLE
    assert forwarder.pool.replicas["http://r0"].consecutive_failures == 0


def test_sampled_requests_get_a_seed_and_seeded_or_greedy_ones_keep_theirs():
    forwarder = make_forwarder(FakeReplicas({"http://r0": answer}))
    assert isinstance(forwarder.prepare({"temperature": 0.8})["seed"], int)
    assert forwarder.prepare({"temperature": 0.8, "seed": 3})["seed"] == 3
    assert "seed" not in forwarder.prepare({"temperature": 0})
