"""The replicas a router knows, and what it knows about each: health (a circuit breaker), the
requests it has in flight through this router, and the load the replica itself reports.

Circuit breaker per replica:

    healthy --N consecutive failures--> ejected --backoff elapsed--> half_open
       ^                                   ^                            |
       +------- probe succeeds ------------+---- probe fails (backoff x2)+

A replica that answers 429 is busy, not failing: that never counts against it. Nor does a probe
that times out while the replica's streams are still sending data: it is busy, not dead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


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
    state: str = "healthy"  # healthy | ejected | half_open | draining
    outstanding: int = 0  # requests in flight through this router (always fresh)
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    eject_s: float = 0.0  # the current backoff
    load: LoadSignals = field(default_factory=LoadSignals)
    info: dict = field(default_factory=dict)  # its /v1/models card: model, layout
    last_data_at: float = 0.0  # time.monotonic() of the last bytes it sent us (a busy replica still streams)

    @property
    def routable(self) -> bool:
        return self.state == "healthy"

    def score(self) -> float:
        """Lower is less loaded: our fresh in-flight count first; the replica's queue (stale)
        only breaks ties, so a burst cannot herd onto a replica whose scrape is old."""
        return self.outstanding + 0.01 * (self.load.num_waiting + self.load.kv_usage)


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
        if replica is None or replica.state == "draining":
            replica = self.replicas[url] = Replica(url, state="half_open")
        return replica

    def drain(self, url: str) -> Replica | None:
        """Stop sending new requests; in-flight ones finish. Removed once idle (`reap`)."""
        replica = self.replicas.get(url.rstrip("/"))
        if replica is not None:
            replica.state = "draining"
        return replica

    def reap(self) -> None:
        for url, replica in list(self.replicas.items()):
            if replica.state == "draining" and replica.outstanding == 0:
                del self.replicas[url]

    def routable(self, exclude: set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable and r.url not in exclude]

    # --- the circuit breaker ----------------------------------------------------------------------
    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        if replica.state == "half_open":
            replica.state, replica.eject_s = "healthy", 0.0

    def record_failure(self, replica: Replica, now: float | None = None) -> None:
        replica.consecutive_failures += 1
        if replica.state == "half_open" or (
                replica.state == "healthy" and replica.consecutive_failures >= self.eject_after_failures):
            self.eject(replica, now)

    def eject(self, replica: Replica, now: float | None = None) -> None:
        if replica.state == "draining":
            return
        now = time.monotonic() if now is None else now
        replica.eject_s = min(self.eject_max_s, replica.eject_s * 2 or self.eject_base_s)
        replica.state, replica.ejected_until = "ejected", now + replica.eject_s
        self.num_ejections[replica.url] = self.num_ejections.get(replica.url, 0) + 1

    def due_for_probe(self, replica: Replica, now: float | None = None) -> bool:
        """An ejected replica whose backoff has passed moves to half-open: the next probe decides."""
        now = time.monotonic() if now is None else now
        if replica.state == "ejected" and now >= replica.ejected_until:
            replica.state = "half_open"
        return replica.state != "draining"
