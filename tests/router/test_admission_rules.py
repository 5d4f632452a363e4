"""Admission (router/admission.py, Forwarder.admit) without HTTP: 503 with no replica, 429 when
saturated, and batch work admitted only while no interactive request is in flight and below
batch_capacity_fraction of the capacity, so an interactive request never waits behind batch
work admitted ahead of it."""
from __future__ import annotations

import random

import pytest

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError, admit
from shardserve.router.replica_pool import ReplicaState
from shardserve.router.retry import Outcome, first_accepting
from tests.router.fake_replicas import FakeReplicas, answer, make_forwarder, metric

CONFIG = RouterConfig(max_outstanding_per_replica=4, batch_capacity_fraction=0.5)
BATCH, INTERACTIVE = {"request_class": "batch"}, {}


def refusal(num_routable: int, num_in_flight: int, is_batch: bool = False, num_interactive: int = 0):
    try:
        admit(CONFIG, num_routable, num_in_flight, is_batch, num_interactive)
    except RouterError as exc:
        return exc.status, exc.retry_after_s, exc.reason
    return None


def test_the_rules():
    assert refusal(0, 0) == (503, 1, "no_replica")
    assert refusal(2, 7) is None and refusal(2, 8) == (429, 1, "saturated")  # capacity 2 x 4
    assert refusal(2, 3, is_batch=True) is None
    assert refusal(2, 4, is_batch=True) == (429, 5, "batch_deferred")  # half the capacity
    assert refusal(2, 0, is_batch=True, num_interactive=1) == (429, 5, "batch_deferred")
    assert refusal(2, 4, num_interactive=4) is None  # interactive work may fill the rest
    with pytest.raises(RouterError, match=r"every replica is saturated \(8 requests in flight\)"):
        admit(CONFIG, 2, 8)


def test_the_forwarder_counts_routable_replicas_only_and_labels_its_refusals():
    forwarder = make_forwarder(FakeReplicas({"http://r0": answer, "http://r1": answer}), max_outstanding_per_replica=2)
    r0, r1 = forwarder.pool.replicas.values()
    held = [r0.lease(), r0.lease()]
    r1.state = ReplicaState.EJECTED
    with pytest.raises(RouterError) as refused:
        forwarder.admit(INTERACTIVE)  # one routable replica, saturated
    assert refused.value.status == 429
    r0.state = ReplicaState.EJECTED
    with pytest.raises(RouterError) as refused:
        forwarder.admit(INTERACTIVE)
    assert refused.value.status == 503
    assert metric(forwarder, "shardserve_router_rejected_total", reason="saturated") == 1
    assert metric(forwarder, "shardserve_router_rejected_total", reason="no_replica") == 1
    for lease in held:
        lease.release()


def test_batch_work_waits_for_interactive_work_and_keeps_room_for_it():
    """Two replicas of 4: batch holds at most 4; an interactive request is always let in and sent
    to a replica at once while the fleet has room, whatever batch work is in flight."""
    forwarder = make_forwarder(FakeReplicas({"http://r0": answer, "http://r1": answer}), max_outstanding_per_replica=4)

    def start(body: dict):
        forwarder.admit(body)
        held_class = forwarder.lease_interactive(body)
        attempt = first_accepting(forwarder.attempts(""), lambda r: Outcome.ACCEPTED)
        return attempt, held_class

    batch = [start(BATCH) for _ in range(4)]  # the fleet is idle: batch work fills half of it
    with pytest.raises(RouterError) as deferred:
        start(BATCH)
    assert (deferred.value.status, deferred.value.retry_after_s) == (429, 5)
    interactive = [start(INTERACTIVE) for _ in range(4)]  # admitted at once, beside the batch backlog
    assert forwarder.num_interactive == 4
    for attempt, _ in batch:
        attempt.lease.release()
    with pytest.raises(RouterError):  # the fleet has room now, but interactive work is in flight
        start(BATCH)
    for attempt, held_class in interactive:
        attempt.lease.release()
        held_class.release()
    assert forwarder.num_interactive == 0
    start(BATCH)


def test_random_traffic_never_admits_batch_work_ahead_of_interactive_work():
    """Seeded arrivals and ends of both classes: a batch request is admitted if and only if no
    interactive request is in flight and the fleet is below half its capacity, and an interactive
    request is refused only when interactive work alone holds the other half."""
    forwarder = make_forwarder(FakeReplicas({"http://r0": answer, "http://r1": answer}), max_outstanding_per_replica=4)
    rng, capacity = random.Random(3), 8
    in_flight: list[tuple] = []
    counts = {"batch": 0, "interactive": 0, "batch_refused": 0, "interactive_refused": 0}
    for _ in range(4000):
        if in_flight and rng.random() < 0.45:
            attempt, held_class = in_flight.pop(rng.randrange(len(in_flight)))
            attempt.lease.release()
            if held_class:
                held_class.release()
            continue
        kind = "batch" if rng.random() < 0.6 else "interactive"
        before_total = sum(r.outstanding for r in forwarder.pool.replicas.values())
        before_interactive = forwarder.num_interactive
        try:
            forwarder.admit(BATCH if kind == "batch" else INTERACTIVE)
        except RouterError:
            counts[f"{kind}_refused"] += 1
            if kind == "interactive":
                assert before_interactive >= capacity - capacity // 2  # never refused for batch work
            else:  # refused only for interactive work in flight or half the capacity taken
                assert before_interactive > 0 or before_total >= capacity // 2
            continue
        if kind == "batch":
            assert before_interactive == 0 and before_total < capacity // 2
        held_class = forwarder.lease_interactive(BATCH if kind == "batch" else INTERACTIVE)
        in_flight.append((first_accepting(forwarder.attempts(""), lambda r: Outcome.ACCEPTED), held_class))
        counts[kind] += 1
    assert all(n > 0 for n in counts.values()), counts  # every case happened
