"""Whether the router takes a request at all, decided once, before any replica is chosen; and
the router's own error answer. The router (Forwarder.admit) and the simulator (SimRouter.route)
both call `admit`, each with counts it keeps.

    no routable replica                                          503  Retry-After 1
    every replica saturated: in flight >= max_outstanding x n    429  Retry-After 1
    a batch request while any interactive request is in flight,
      or while the fleet is at batch_capacity_fraction of it     429  Retry-After 5

Batch work only fills idle capacity: it is never admitted ahead of an interactive request in
flight, and it holds at most `batch_capacity_fraction` of the fleet when an interactive request
arrives, so there is room for that request at once (it is not queued behind the batch backlog).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import RouterConfig


@dataclass
class RouterError(Exception):
    """The router's answer instead of a replica's: `status` and `message` (the OpenAI error
    shape), `Retry-After` in seconds, and for an admission refusal its metrics label `reason`."""

    status: int
    message: str
    retry_after_s: int | None = None
    reason: str | None = None


def admit(config: RouterConfig, num_routable: int, num_in_flight: int, is_batch: bool = False,
          num_interactive: int = 0) -> None:
    """Raise RouterError if the request is refused (module docstring); `num_in_flight` counts
    the requests in flight on the `num_routable` routable replicas, `num_interactive` the
    interactive ones among all requests in flight."""
    if num_routable == 0:
        raise RouterError(503, "no replica is available", 1, "no_replica")
    capacity = config.max_outstanding_per_replica * num_routable
    if num_in_flight >= capacity:
        raise RouterError(429, f"every replica is saturated ({num_in_flight} requests in flight); retry later", 1,
                          "saturated")
    if is_batch and (num_interactive > 0 or num_in_flight >= config.batch_capacity_fraction * capacity):
        raise RouterError(429, "batch requests are admitted only while the fleet has idle capacity", 5,
                          "batch_deferred")
