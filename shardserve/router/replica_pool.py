"""The replicas a router knows, and what it knows about each: health (a circuit breaker), the
requests it has in flight through this router, and the load the replica itself reports.

Circuit breaker per replica:

    healthy --N consecutive failures--> ejected --backoff elapsed--> half_open
       ^                                   ^                            |
       +------- probe succeeds ------------+---- probe fails (backoff x2)+

A replica that answers 429 is busy, not failing: that never counts against it. Nor does a probe
that times out while the replica's streams are still sending data: it is busy, not dead. Apart
from the breaker, a healthy replica whose probe has gone unanswered for a probe interval, with no
stream sending anything either (frozen, e.g. SIGSTOP), is unresponsive: it gets no new requests
until it answers again, long before the breaker would eject it. A draining
replica is never ejected: it takes no new requests and leaves the pool once idle (`reap`).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from shardserve.router.lease import Lease


class ReplicaState(enum.StrEnum):
    """A replica's place in the circuit breaker. A str enum: /admin/status, the metrics' labels and
    code comparing with the plain names ("healthy") see the same strings as before."""

    HEALTHY = "healthy"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"
    DRAINING = "draining"


@dataclass
class LoadSignals:
    """The replica's own view, scraped from its /metrics (stale by up to a probe interval)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float = 0.0


@dataclass
class Replica:
    url: str
    state: ReplicaState = ReplicaState.HEALTHY
    outstanding: int = 0  # requests in flight through this router (always fresh); changed only by leases
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    eject_s: float = 0.0  # the current backoff
    load: LoadSignals = field(default_factory=LoadSignals)
    info: dict = field(default_factory=dict)  # its /v1/models card: model, layout
    last_data_at: float = 0.0  # time.monotonic() of the last bytes it sent us (a busy replica still streams)
    responsive: bool = True  # False while a probe has gone unanswered with no stream sending (health.py)

    @property
    def routable(self) -> bool:
        return self.state is ReplicaState.HEALTHY and self.responsive

    def saturated(self, max_outstanding: int) -> bool:
        """Whether it takes no more requests from this router (`max_outstanding_per_replica`)."""
        return self.outstanding >= max_outstanding

    def lease(self) -> Lease:
        """A place in `outstanding` for one request sent to this replica, until released."""
        return Lease(self.count_in_flight)

    def count_in_flight(self, delta: int) -> None:
        """`outstanding`'s only writer, called by leases (+1 when taken, -1 once when released)."""
        self.outstanding += delta

    def score(self) -> tuple[int, float]:
        """Lower is less loaded: our fresh in-flight count first; the replica's queue and KV use
        (stale) only break ties, so a burst cannot herd onto a replica whose scrape is old. A pair,
        not a weighted sum: under any weight a long enough queue outweighs a request in flight."""
        return self.outstanding, self.load.num_waiting + self.load.kv_usage


class ReplicaPool:
    def __init__(self, urls: list[str], eject_after_failures: int, eject_base_s: float, eject_max_s: float):
        self.replicas: dict[str, Replica] = {}
        self.eject_after_failures = eject_after_failures
        self.eject_base_s, self.eject_max_s = eject_base_s, eject_max_s
        self.num_ejections: dict[str, int] = {}
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Replica:
        """A new replica starts half-open: it takes traffic only after its first probe succeeds."""
        url = url.rstrip("/")
        replica = self.replicas.get(url)
        if replica is None or replica.state is ReplicaState.DRAINING:
            replica = self.replicas[url] = Replica(url, state=ReplicaState.HALF_OPEN)
        return replica

    def drain(self, url: str) -> Replica | None:
        """Stop sending new requests; in-flight ones finish. Removed once idle (`reap`)."""
        replica = self.replicas.get(url.rstrip("/"))
        if replica is not None:
            replica.state = ReplicaState.DRAINING
        return replica

    def reap(self) -> None:
        for url, replica in list(self.replicas.items()):
            if replica.state is ReplicaState.DRAINING and replica.outstanding == 0:
                del self.replicas[url]

    def routable(self, exclude: Collection[str] = ()) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable and r.url not in exclude]

    # --- the circuit breaker ----------------------------------------------------------------------
    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        if replica.state is ReplicaState.HALF_OPEN:
            replica.state, replica.eject_s = ReplicaState.HEALTHY, 0.0

    def record_failure(self, replica: Replica, now: float | None = None) -> None:
        replica.consecutive_failures += 1
        if replica.state is ReplicaState.HALF_OPEN or (
                replica.state is ReplicaState.HEALTHY and replica.consecutive_failures >= self.eject_after_failures):
            self.eject(replica, now)

    def eject(self, replica: Replica, now: float | None = None) -> None:
        if replica.state is ReplicaState.DRAINING:
            return
        now = time.monotonic() if now is None else now
        replica.eject_s = min(self.eject_max_s, replica.eject_s * 2 or self.eject_base_s)
        replica.state, replica.ejected_until = ReplicaState.EJECTED, now + replica.eject_s
        self.num_ejections[replica.url] = self.num_ejections.get(replica.url, 0) + 1

    def due_for_probe(self, replica: Replica, now: float | None = None) -> bool:
        """An ejected replica whose backoff has passed moves to half-open: the next probe decides."""
        now = time.monotonic() if now is None else now
        if replica.state is ReplicaState.EJECTED and now >= replica.ejected_until:
            replica.state = ReplicaState.HALF_OPEN
        return replica.state is not ReplicaState.DRAINING
