"""The circuit breaker in ReplicaPool, driven with explicit times: ejection after N failures, the
backoff doubling to its cap, half-open readmission and re-ejection, draining, and reaping."""
from __future__ import annotations

import json

from shardserve.router.replica_pool import LoadSignals, Replica, ReplicaPool, ReplicaState

T0 = 1000.0


def pool_of(*urls: str, eject_after: int = 3) -> ReplicaPool:
    pool = ReplicaPool(list(urls), eject_after_failures=eject_after, eject_base_s=2.0, eject_max_s=30.0)
    for replica in pool.replicas.values():
        pool.record_success(replica)
    return pool


def test_a_new_replica_is_half_open_until_its_first_probe_succeeds():
    pool = ReplicaPool(["http://r0/"], 3, 2.0, 30.0)
    replica = pool.replicas["http://r0"]  # the trailing slash is dropped
    assert replica.state is ReplicaState.HALF_OPEN and pool.routable() == []
    pool.record_success(replica)
    assert replica.state is ReplicaState.HEALTHY and pool.routable() == [replica]
    assert pool.add("http://r0") is replica  # adding a known replica again keeps it


def test_n_consecutive_failures_eject_a_healthy_replica():
    pool = pool_of("http://r0")
    replica = pool.replicas["http://r0"]
    pool.record_failure(replica, T0)
    pool.record_success(replica)  # a success in between starts the count again
    pool.record_failure(replica, T0)
    pool.record_failure(replica, T0)
    assert replica.state is ReplicaState.HEALTHY
    pool.record_failure(replica, T0)
    assert replica.state is ReplicaState.EJECTED and replica.ejected_until == T0 + 2.0
    assert pool.routable() == [] and pool.num_ejections == {"http://r0": 1}


def test_the_backoff_doubles_on_each_failed_half_open_probe_up_to_its_cap():
    pool = pool_of("http://r0", eject_after=1)
    replica, now, backoffs = pool.replicas["http://r0"], T0, []
    pool.record_failure(replica, now)
    for _ in range(6):
        backoffs.append(replica.eject_s)
        pool.due_for_probe(replica, now + replica.eject_s - 0.01)
        assert replica.state is ReplicaState.EJECTED  # not half-open before its backoff has passed
        now += replica.eject_s
        assert pool.due_for_probe(replica, now) and replica.state is ReplicaState.HALF_OPEN
        pool.record_failure(replica, now)  # the half-open probe fails: ejected again at once
        assert replica.state is ReplicaState.EJECTED
    assert backoffs == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_successful_half_open_probe_readmits_and_resets_the_backoff():
    pool = pool_of("http://r0", eject_after=1)
    replica = pool.replicas["http://r0"]
    pool.record_failure(replica, T0)
    pool.due_for_probe(replica, T0 + 2.0)
    pool.record_failure(replica, T0 + 2.0)
    assert replica.eject_s == 4.0
    pool.due_for_probe(replica, T0 + 6.0)
    pool.record_success(replica)
    assert replica.state is ReplicaState.HEALTHY and replica.eject_s == 0.0
    pool.record_failure(replica, T0 + 7.0)
    assert replica.eject_s == 2.0  # the next ejection starts from the base again


def test_a_draining_replica_is_never_ejected_and_not_probed():
    pool = pool_of("http://r0", "http://r1")
    replica = pool.drain("http://r0")
    for _ in range(5):
        pool.record_failure(replica, T0)
    pool.eject(replica, T0)
    assert replica.state is ReplicaState.DRAINING and pool.num_ejections == {}
    assert not pool.due_for_probe(replica, T0) and pool.routable() == [pool.replicas["http://r1"]]
    assert pool.drain("http://nowhere") is None


def test_reap_removes_a_draining_replica_once_idle():
    pool = pool_of("http://r0", "http://r1")
    replica = pool.drain("http://r0")
    lease = replica.lease()
    pool.reap()
    assert "http://r0" in pool.replicas  # a request is still in flight on it
    lease.release()
    pool.reap()
    assert list(pool.replicas) == ["http://r1"]  # an idle healthy replica stays


def test_adding_a_draining_replica_again_starts_it_afresh():
    pool = pool_of("http://r0")
    old = pool.drain("http://r0")
    new = pool.add("http://r0")
    assert new is not old and new.state is ReplicaState.HALF_OPEN


def test_states_read_as_their_plain_names():
    assert ReplicaState.HALF_OPEN == "half_open" and f"{ReplicaState.EJECTED}" == "ejected"
    assert json.dumps({"state": ReplicaState.DRAINING}) == '{"state": "draining"}'


def test_the_score_is_in_flight_first_and_the_scraped_queue_after():
    replica = Replica("http://r0", outstanding=2, load=LoadSignals(num_waiting=3, kv_usage=0.5))
    assert replica.score() == (2, 3.5)
    assert replica.saturated(2) and not replica.saturated(3)
