"""HealthMonitor's probe decisions against a fake replica and a fake clock: readmission, failures
and ejection after N failed probes, a slow probe of a replica that is still streaming (busy, not
dead), backoff before a half-open probe, and the load scrape."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from shardserve.router.health import HealthMonitor
from shardserve.router.replica_pool import ReplicaPool, ReplicaState
from tests.router.fake_replicas import FakeClock

METRICS = "vllm:num_requests_running 2.0\nvllm:num_requests_waiting 3.0\nvllm:kv_cache_usage_perc 0.25\n"


def ok() -> httpx.Response:
    return httpx.Response(200, json={"status": "ok"})


def unhealthy() -> httpx.Response:
    return httpx.Response(503)


def timeout() -> httpx.Response:
    raise httpx.ReadTimeout("no answer within the probe timeout")


def refused() -> httpx.Response:
    raise httpx.ConnectError("connection refused")


class FakeReplica:
    """http://r0: /health answers as `health` (changeable), /metrics and /v1/models as a server."""

    def __init__(self, health: Callable[[], httpx.Response]):
        self.health, self.paths, self.timeouts = health, [], []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        self.timeouts.append(request.extensions["timeout"]["read"])
        if request.url.path == "/health":
            return self.health()
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(200, json={"data": [{"id": "tiny", "layout": "tp1"}]})


def monitor(fake: FakeReplica, eject_after: int = 2) -> tuple[HealthMonitor, ReplicaPool, FakeClock]:
    """The pool holds http://r0, half-open as a new replica is."""
    pool, clock = ReplicaPool(["http://r0"], eject_after, 2.0, 30.0), FakeClock()
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    return HealthMonitor(pool, client, interval_s=0.5, timeout_s=1.0, clock=clock), pool, clock


def test_a_successful_probe_readmits_and_scrapes_the_load_and_model_card():
    health, pool, _ = monitor(FakeReplica(ok))
    asyncio.run(health.check_all())
    replica = pool.replicas["http://r0"]
    assert replica.state is ReplicaState.HEALTHY
    assert (replica.load.num_running, replica.load.num_waiting, replica.load.kv_usage) == (2.0, 3.0, 0.25)
    assert replica.info == {"id": "tiny", "layout": "tp1"}


def test_n_failed_probes_eject_a_healthy_replica():
    fake = FakeReplica(ok)
    health, pool, _ = monitor(fake, eject_after=2)
    replica = pool.replicas["http://r0"]
    asyncio.run(health.check_all())
    for failing in (unhealthy, refused):
        assert replica.state is ReplicaState.HEALTHY
        fake.health = failing
        asyncio.run(health.check_all())
    assert replica.state is ReplicaState.EJECTED  # at the second failed probe: one per probe round
    assert set(fake.timeouts) == {1.0}  # each bounded by the probe timeout: ejected within N x (timeout + interval)


def test_a_slow_probe_of_a_replica_still_streaming_is_no_failure():
    fake = FakeReplica(ok)
    health, pool, clock = monitor(fake)
    replica = pool.replicas["http://r0"]
    asyncio.run(health.check(replica))
    fake.health = timeout
    replica.last_data_at = clock() - 0.5  # it sent a chunk within the probe timeout
    asyncio.run(health.check(replica))
    assert replica.consecutive_failures == 0 and replica.state is ReplicaState.HEALTHY
    replica.last_data_at = clock() - 1.0  # silent for the probe timeout: a failure
    asyncio.run(health.check(replica))
    assert replica.consecutive_failures == 1


def test_an_ejected_replica_is_probed_again_only_after_its_backoff():
    fake = FakeReplica(refused)
    health, pool, clock = monitor(fake, eject_after=1)
    replica = pool.replicas["http://r0"]
    asyncio.run(health.check_all())  # half-open and failing: ejected for 2 s
    assert replica.state is ReplicaState.EJECTED and fake.paths == ["/health"]
    clock.advance(1.9)
    asyncio.run(health.check_all())
    assert fake.paths == ["/health"]  # not probed during its backoff
    clock.advance(0.1)
    fake.health = ok
    asyncio.run(health.check_all())
    assert replica.state is ReplicaState.HEALTHY and fake.paths[1] == "/health"


def test_check_all_reaps_idle_draining_replicas():
    fake = FakeReplica(ok)
    health, pool, _ = monitor(fake)
    pool.drain("http://r0")
    asyncio.run(health.check_all())
    assert pool.replicas == {} and fake.paths == []


def test_a_probe_unanswered_for_an_interval_stops_new_requests_until_it_answers():
    """A frozen replica (its probe hangs) is unroutable one probe interval into the probe, long
    before the probe timeout or the breaker; not a replica whose streams are still sending."""
    for streaming in (False, True):
        answer = asyncio.Event()
        fake = FakeReplica(ok)
        health, pool, clock = monitor(fake)
        replica = pool.replicas["http://r0"]
        asyncio.run(health.check(replica))
        replica.last_data_at = clock() - (0.1 if streaming else 10.0)

        async def hanging_probe(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/health":
                await answer.wait()
            return fake.handle(request)

        async def scenario() -> list[bool]:
            health.client = httpx.AsyncClient(transport=httpx.MockTransport(hanging_probe))
            probing = asyncio.ensure_future(health.check(replica))
            await asyncio.sleep(health.interval_s + 0.2)
            during = replica.routable
            answer.set()
            await probing
            return [during, replica.routable]

        assert asyncio.run(scenario()) == [streaming, True]
        assert replica.state is ReplicaState.HEALTHY and replica.consecutive_failures == 0
