"""The router in front of simulated replicas: the real router's admission rule (admission.py), its
retry loop (retry.py), its policy objects and its ReplicaPool of `Replica` records, kept as the
real router keeps them (requests in flight through it, each held by a lease; load scraped from
each replica every probe interval). Simulated replicas never fail; one that answers 429 is busy.

Every decision is the shared one. A policy scans all candidates, which at 1,000 replicas and a
million requests costs minutes, so while every replica is a candidate (none saturated, none tried
yet) three policies answer from an index kept alongside, proven equal to the real object's answer
(tests/sim/test_sim_router.py):

    round_robin        the real object's counter, advanced as it advances it, into the replicas
                       sorted by url (the order it sorts them in)
    least_outstanding  a heap of (score, index) with stale entries skipped: the real min() by
                       (score, url), as urls are numbered in index order
    power_of_two       the real object itself, given the cached list of all replicas (O(1))

prefix_aware always asks the real object (rendezvous hashing ranks every replica: O(replicas)).
The index follows every change of a replica's in-flight count: the leases the simulator takes
count through `_count_in_flight`.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from functools import partial

from shardserve.config import RouterConfig
from shardserve.router.admission import admit
from shardserve.router.lease import Lease
from shardserve.router.policies import LeastOutstanding, PowerOfTwo, RoundRobin, make_policy
from shardserve.router.replica_pool import LoadSignals, Replica, ReplicaPool
from shardserve.router.retry import Attempts, Outcome, first_accepting


class SimRouter:
    def __init__(self, num_replicas: int, policy: str, config: RouterConfig):
        self.config = config
        urls = [f"sim://replica-{i:06d}" for i in range(num_replicas)]
        self.pool = ReplicaPool(urls, config.eject_after_failures, config.eject_base_s, config.eject_max_s)
        self.replicas = list(self.pool.replicas.values())
        for replica in self.replicas:  # the start-up probe: every simulated replica answers
            self.pool.record_success(replica)
        self.policy = make_policy(policy, config.prefix_chars, config.prefix_load_slack)
        self.num_saturated = 0
        self.num_in_flight = 0
        self._leases: list[list[Lease]] = [[] for _ in range(num_replicas)]  # per replica: its requests'
        self._index = {r.url: i for i, r in enumerate(self.replicas)}
        self._by_url = sorted(range(num_replicas), key=lambda i: self.replicas[i].url)
        self._heap: list[tuple[float, int]] = []  # (score, index): index order is url order
        if isinstance(self.policy, LeastOutstanding):
            self._rebuild_heap()

    # --- what the router knows ----------------------------------------------------------------------
    def _count_in_flight(self, replica: Replica, delta: int) -> None:
        """A lease on `replica` taken (+1) or released (-1): the replica's count and the index."""
        cap = self.config.max_outstanding_per_replica
        was_saturated = replica.saturated(cap)
        replica.count_in_flight(delta)
        self.num_saturated += replica.saturated(cap) - was_saturated
        self.num_in_flight += delta
        if isinstance(self.policy, LeastOutstanding):
            heapq.heappush(self._heap, (replica.score(), self._index[replica.url]))
            if len(self._heap) > 8 * len(self.replicas) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(r.score(), i) for i, r in enumerate(self.replicas)]
        heapq.heapify(self._heap)

    def request_ended(self, i: int) -> None:
        self._leases[i].pop().release()

    def scraped(self, signals: list[LoadSignals]) -> None:
        """New load signals for every replica (the health monitor's scrape)."""
        for replica, load in zip(self.replicas, signals):
            replica.load = load
        if isinstance(self.policy, LeastOutstanding):
            self._rebuild_heap()

    # --- one request --------------------------------------------------------------------------------
    def route(self, prefix: str, submit: Callable[[int], bool]) -> int:
        """Pick replicas until one accepts (`submit(i)` is False when replica i answers 429);
        returns its index, the request's lease on it held until `request_ended(i)`. Raises
        RouterError as the real router answers."""
        admit(self.config, len(self.replicas), self.num_in_flight)
        attempt = first_accepting(_SimAttempts(self, prefix),
                                  lambda r: Outcome.ACCEPTED if submit(self._index[r.url]) else Outcome.BUSY)
        i = self._index[attempt.replica.url]
        self._leases[i].append(attempt.lease)
        return i

    def pick_from_all(self, prefix: str) -> Replica:
        """The policy's choice among all replicas, from the index (module docstring)."""
        policy = self.policy
        if isinstance(policy, RoundRobin):  # RoundRobin.choose, on the replicas sorted by url
            policy.counter += 1
            return self.replicas[self._by_url[policy.counter % len(self._by_url)]]
        if isinstance(policy, LeastOutstanding):  # min by (score, url): the heap's valid top
            heap = self._heap
            while True:
                score, i = heap[0]
                if score == self.replicas[i].score():
                    return self.replicas[i]
                heapq.heappop(heap)
        if isinstance(policy, PowerOfTwo):
            return policy.choose(self.replicas, prefix)
        return policy.choose(list(self.replicas), prefix)


class _SimAttempts(Attempts):
    """The shared Attempts with the simulator's two shortcuts: the first pick from the index while
    every replica is a candidate, and leases that keep the index current."""

    def __init__(self, router: SimRouter, prefix: str):
        super().__init__(router.config, router.pool, router.policy, prefix)
        self.router = router

    def choose(self) -> Replica:
        if not self.tried and self.router.num_saturated == 0:
            return self.router.pick_from_all(self.prefix)
        return super().choose()

    def lease(self, replica: Replica) -> Lease:
        return Lease(partial(self.router._count_in_flight, replica))
