"""The router in front of simulated replicas: the real router's policy objects and `Replica`
records, kept as the real router keeps them (requests in flight through it, load scraped from each
replica every probe interval), and its admission rules (a replica with `max_outstanding_per_replica`
in flight is saturated; all saturated: 429; a replica that answers 429 is busy: try another, at most
`max_attempts`).

Every decision is the real policy's. A policy scans all candidates, which at 1,000 replicas and a
million requests costs minutes, so while every replica is a candidate (none saturated, none tried
yet) three policies answer from an index kept alongside, proven equal to the real object's answer
(tests/sim/test_sim_router.py):

    round_robin        the real object's counter, advanced as it advances it, into the replicas
                       sorted by url (the order it sorts them in)
    least_outstanding  a heap of (score, index) with stale entries skipped: the real min() by
                       (score, url), as urls are numbered in index order
    power_of_two       the real object itself, given the cached list of all replicas (O(1))

prefix_aware always asks the real object (rendezvous hashing ranks every replica: O(replicas)).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from shardserve.config import RouterConfig
from shardserve.router.policies import LeastOutstanding, PowerOfTwo, RoundRobin, make_policy
from shardserve.router.replica_pool import LoadSignals, Replica


class RouteRejected(Exception):
    """The router answers the client with an error (`status`, `message` as the real one says)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class SimRouter:
    def __init__(self, num_replicas: int, policy: str, config: RouterConfig):
        self.config = config
        self.replicas = [Replica(url=f"sim://replica-{i:06d}") for i in range(num_replicas)]
        self.policy = make_policy(policy, config.prefix_chars, config.prefix_load_slack)
        self.num_saturated = 0
        self._index = {r.url: i for i, r in enumerate(self.replicas)}
        self._by_url = sorted(range(num_replicas), key=lambda i: self.replicas[i].url)
        self._heap: list[tuple[float, int]] = []  # (score, index): index order is url order
        if isinstance(self.policy, LeastOutstanding):
            self._rebuild_heap()

    # --- what the router knows ----------------------------------------------------------------------
    def _changed(self, i: int) -> None:
        if isinstance(self.policy, LeastOutstanding):
            replica = self.replicas[i]
            heapq.heappush(self._heap, (replica.score(), i))
            if len(self._heap) > 8 * len(self.replicas) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(r.score(), i) for i, r in enumerate(self.replicas)]
        heapq.heapify(self._heap)

    def _add_outstanding(self, i: int, delta: int) -> None:
        replica = self.replicas[i]
        cap = self.config.max_outstanding_per_replica
        was_saturated = replica.outstanding >= cap
        replica.outstanding += delta
        self.num_saturated += (replica.outstanding >= cap) - was_saturated
        self._changed(i)

    def request_ended(self, i: int) -> None:
        self._add_outstanding(i, -1)

    def scraped(self, signals: list[LoadSignals]) -> None:
        """New load signals for every replica (the health monitor's scrape)."""
        for replica, load in zip(self.replicas, signals):
            replica.load = load
        if isinstance(self.policy, LeastOutstanding):
            self._rebuild_heap()

    # --- one request --------------------------------------------------------------------------------
    def route(self, prefix: str, submit: Callable[[int], bool]) -> int:
        """Pick replicas until one accepts (`submit(i)` is False when replica i answers 429);
        returns its index, its outstanding count raised. Raises RouteRejected like the real router."""
        cap = self.config.max_outstanding_per_replica
        if self.num_saturated == len(self.replicas):
            in_flight = sum(r.outstanding for r in self.replicas)
            raise RouteRejected(429, f"every replica is saturated ({in_flight} requests in flight); retry later")
        tried: set[str] = set()
        while True:
            if len(tried) >= self.config.max_attempts:
                raise RouteRejected(503, f"the request failed on {len(tried)} replicas")
            i = self._pick(prefix, tried, cap)
            tried.add(self.replicas[i].url)
            if submit(i):
                self._add_outstanding(i, +1)
                return i

    def _pick(self, prefix: str, tried: set[str], cap: int) -> int:
        if not tried and self.num_saturated == 0:
            return self._pick_from_all(prefix)
        candidates = [r for r in self.replicas if r.url not in tried and r.outstanding < cap]
        if not candidates:
            raise RouteRejected(429, "no replica can take the request now; retry later")
        return self._index[self.policy.choose(candidates, prefix).url]

    def _pick_from_all(self, prefix: str) -> int:
        policy = self.policy
        if isinstance(policy, RoundRobin):  # RoundRobin.choose, on the replicas sorted by url
            policy.counter += 1
            return self._by_url[policy.counter % len(self._by_url)]
        if isinstance(policy, LeastOutstanding):  # min by (score, url): the heap's valid top
            heap = self._heap
            while True:
                score, i = heap[0]
                if score == self.replicas[i].score():
                    return i
                heapq.heappop(heap)
        if isinstance(policy, PowerOfTwo):
            return self._index[policy.choose(self.replicas, prefix).url]
        return self._index[policy.choose(list(self.replicas), prefix).url]
