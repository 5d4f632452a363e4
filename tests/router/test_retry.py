"""The shared retry loop (router/retry.py) over a real ReplicaPool, without HTTP: busy replicas
are skipped without a failure, failures count and eject, max_attempts gives 503, no candidate
left gives 429 (503 with no routable replica), and each lease is released exactly once."""
from __future__ import annotations

import pytest

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError
from shardserve.router.policies import LeastOutstanding
from shardserve.router.replica_pool import ReplicaState
from shardserve.router.retry import Attempts, Outcome, first_accepting
from tests.router.fake_replicas import healthy_pool

URLS = ("http://r0", "http://r1", "http://r2")


def attempts_over(**settings) -> Attempts:
    config = RouterConfig(replicas=URLS, **settings)
    return Attempts(config, healthy_pool(config), LeastOutstanding(), "")


def answers(**by_url: Outcome):
    """send(): each replica's outcome by its name (r0, r1, ...), ACCEPTED when not given."""
    return lambda replica: by_url.get(replica.url.removeprefix("http://"), Outcome.ACCEPTED)


def in_flight(attempts: Attempts) -> list[int]:
    return [r.outstanding for r in attempts.pool.replicas.values()]


def test_busy_replicas_are_skipped_without_a_failure():
    attempts = attempts_over()
    attempt = first_accepting(attempts, answers(r0=Outcome.BUSY, r1=Outcome.BUSY))
    assert attempt.replica.url == "http://r2" and attempts.tried == list(URLS)
    assert [r.consecutive_failures for r in attempts.pool.replicas.values()] == [0, 0, 0]
    assert in_flight(attempts) == [0, 0, 1]  # only the accepting attempt still holds its lease
    attempt.lease.release()
    assert in_flight(attempts) == [0, 0, 0]


def test_failures_count_against_the_breaker_and_eject():
    attempts = attempts_over(eject_after_failures=1)
    attempt = first_accepting(attempts, answers(r0=Outcome.FAILED))
    r0 = attempts.pool.replicas["http://r0"]
    assert attempt.replica.url == "http://r1" and r0.state is ReplicaState.EJECTED
    attempt.lease.release()
    again = Attempts(attempts.config, attempts.pool, attempts.policy, "")
    assert first_accepting(again, answers()).replica.url == "http://r1"  # the ejected replica is not tried
    assert again.tried == ["http://r1"]


def test_max_attempts_gives_503():
    attempts = attempts_over(max_attempts=2)
    with pytest.raises(RouterError) as refused:
        first_accepting(attempts, answers(r0=Outcome.FAILED, r1=Outcome.FAILED))
    assert refused.value.status == 503 and refused.value.message == "the request failed on 2 replicas"
    assert attempts.tried == ["http://r0", "http://r1"] and in_flight(attempts) == [0, 0, 0]


def test_no_candidate_left_gives_429_while_a_replica_is_routable():
    attempts = attempts_over()
    with pytest.raises(RouterError) as refused:
        first_accepting(attempts, answers(r0=Outcome.BUSY, r1=Outcome.BUSY, r2=Outcome.BUSY))
    assert refused.value.status == 429 and refused.value.retry_after_s == 1


def test_no_candidate_left_gives_503_once_none_is_routable():
    attempts = attempts_over(eject_after_failures=1)
    with pytest.raises(RouterError) as refused:
        first_accepting(attempts, answers(r0=Outcome.FAILED, r1=Outcome.FAILED, r2=Outcome.FAILED))
    assert refused.value.status == 503 and "no replica can take" in refused.value.message


def test_saturated_replicas_are_not_tried():
    attempts = attempts_over(max_outstanding_per_replica=1)
    held = [attempts.pool.replicas[url].lease() for url in URLS[:2]]
    assert first_accepting(attempts, answers()).replica.url == "http://r2" and attempts.tried == ["http://r2"]
    for lease in held:
        lease.release()


def test_a_resume_continues_the_same_attempts():
    """A stream failing mid-way settles FAILED and asks for the next replica: one max_attempts."""
    attempts = attempts_over(max_attempts=2)
    first = attempts.next()
    assert attempts.settle(first, Outcome.ACCEPTED)
    attempts.settle(first, Outcome.FAILED)  # it broke mid-stream
    second = attempts.next()
    assert second.replica.url == "http://r1" and in_flight(attempts) == [0, 1, 0]
    with pytest.raises(RouterError) as refused:
        attempts.next()
    assert refused.value.status == 503


def test_an_exception_while_sending_releases_the_lease_and_blames_no_replica():
    attempts = attempts_over()

    def send(replica):
        raise KeyError("a bug, not the replica's failure")
    with pytest.raises(KeyError):
        first_accepting(attempts, send)
    assert in_flight(attempts) == [0, 0, 0]
    assert [r.consecutive_failures for r in attempts.pool.replicas.values()] == [0, 0, 0]


def test_a_lease_settled_twice_is_released_once():
    attempts = attempts_over()
    attempt = attempts.next()
    attempts.settle(attempt, Outcome.BUSY)
    attempts.settle(attempt, Outcome.FAILED)
    attempt.lease.release()
    assert in_flight(attempts) == [0, 0, 0]


def test_success_resets_the_failure_count_and_readmits_a_half_open_replica():
    attempts = attempts_over(eject_after_failures=3)
    r0 = attempts.pool.replicas["http://r0"]
    r0.consecutive_failures, r0.state = 2, ReplicaState.HEALTHY
    attempt = first_accepting(attempts, answers())
    attempts.succeeded(attempt)
    assert r0.consecutive_failures == 0
    r0.state = ReplicaState.HALF_OPEN
    attempts.succeeded(attempt)
    assert r0.state is ReplicaState.HEALTHY
