"""The simulated router decides as the real one: its picks, driven through random traffic (routes,
busy replicas, ends, load scrapes), equal the real Forwarder's admission and the shared retry loop
(router/retry.py, without the simulator's index) with the real policy objects over a real
ReplicaPool in the same state."""
from __future__ import annotations

import json
import random

import pytest

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError
from shardserve.router.app import _prompt_prefix
from shardserve.router.forwarding import Forwarder
from shardserve.router.lease import Lease
from shardserve.router.metrics import RouterMetrics
from shardserve.router.policies import make_policy
from shardserve.router.replica_pool import LoadSignals, ReplicaPool
from shardserve.router.retry import Outcome, first_accepting
from shardserve.sim.sim_router import SimRouter

POLICIES = ["round_robin", "least_outstanding", "power_of_two", "prefix_aware"]


class RealRouter:
    """The real router's decision path: Forwarder.admit, then the shared retry loop over the real
    pool (Forwarder.attempts: no shortcut), a replica's 429 being a BUSY outcome."""

    def __init__(self, urls: list[str], policy: str, config: RouterConfig):
        self.config = config
        self.pool = ReplicaPool(urls, config.eject_after_failures, config.eject_base_s, config.eject_max_s)
        for replica in self.pool.replicas.values():  # the start-up probe: every replica answers
            self.pool.record_success(replica)
        chooser = make_policy(policy, config.prefix_chars, config.prefix_load_slack)
        self.forwarder = Forwarder(config, self.pool, chooser, None, RouterMetrics(policy))
        self.leases: dict[str, list[Lease]] = {url: [] for url in self.pool.replicas}

    def route(self, prefix: str, accepts) -> tuple[list[str], int | None]:
        """(urls tried in order, status of the refusal or None)."""
        attempts = self.forwarder.attempts(prefix)
        try:
            self.forwarder.admit({})
            attempt = first_accepting(attempts, lambda r: Outcome.ACCEPTED if accepts(r.url) else Outcome.BUSY)
        except RouterError as exc:
            return attempts.tried, exc.status
        self.leases[attempt.replica.url].append(attempt.lease)
        return attempts.tried, None

    def request_ended(self, url: str) -> None:
        self.leases[url].pop().release()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_replicas", [1, 5, 40])
def test_sim_router_picks_what_the_real_router_picks(policy, num_replicas):
    rng = random.Random(num_replicas)
    config = RouterConfig(max_outstanding_per_replica=4, max_attempts=3, prefix_chars=24)
    sim = SimRouter(num_replicas, policy, config)
    real = RealRouter([r.url for r in sim.replicas], policy, config)
    in_flight: list[int] = []
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(15)]
    num_rejected = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.55:
            prompt = rng.choice(prompts)
            prefix = _prompt_prefix({"prompt": prompt}, config.prefix_chars)
            assert prefix == json.dumps(prompt)[:config.prefix_chars]  # as the simulation builds it
            busy = {r.url for r in sim.replicas if rng.random() < 0.15}  # these answer 429 this time
            tried_sim: list[str] = []

            def submit(i: int) -> bool:
                tried_sim.append(sim.replicas[i].url)
                return sim.replicas[i].url not in busy
            try:
                chosen, status = sim.route(prefix, submit), None
                in_flight.append(chosen)
            except RouterError as exc:
                status = exc.status
                num_rejected += 1
            tried_real, real_status = real.route(prefix, lambda url: url not in busy)
            assert (tried_sim, status) == (tried_real, real_status)
        elif op < 0.9 and in_flight:
            i = in_flight.pop(rng.randrange(len(in_flight)))
            sim.request_ended(i)
            real.request_ended(sim.replicas[i].url)
        else:
            loads = [LoadSignals(rng.randrange(8), rng.randrange(3), rng.random(), 0.0) for _ in sim.replicas]
            sim.scraped(loads)
            for replica, load in zip(real.pool.replicas.values(), loads):
                replica.load = load
        for s, r in zip(sim.replicas, real.pool.replicas.values()):
            assert s.outstanding == r.outstanding
    assert num_rejected > 0 and len(in_flight) > 0  # both saturation and routing happened
