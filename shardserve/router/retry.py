"""One request's tries over the replicas: which replica next, what its answer means, and when to
give up. The one home of the retry rule: the router's forwarding (async, over HTTP) and the
simulator's router (sync) both walk each request through an `Attempts`; neither decides itself.

    admission.admit, once per request; then, until a replica accepts:
      next()      the policy's pick among the replicas that are routable, not saturated and not
                  yet tried by this request, with a lease on it for the attempt
                    max_attempts tried already        RouterError 503 ("failed on N replicas")
                    no candidate left                 429 while some replica is routable, else 503
      settle()    ACCEPTED  it took the request: the lease is the caller's until the request ends
                  BUSY      it answered 429: lease released, try another; not a failure
                            (forget_busy() makes the busy ones candidates again, for a wait)
                  FAILED    5xx, connection lost, stall, ejected: lease released, one failure on
                            its circuit breaker (ReplicaPool), try another
      succeeded() it answered in full: its breaker's count of failures starts again

A stream that breaks mid-way settles its attempt FAILED and asks the same Attempts for the next
replica, so first tries, retries and resumes share one `max_attempts`.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError
from shardserve.router.lease import Lease
from shardserve.router.policies import RoutingPolicy
from shardserve.router.replica_pool import Replica, ReplicaPool


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    BUSY = "busy"
    FAILED = "failed"


class ReplicaBusy(Exception):
    """The replica answered 429 (the I/O code's way to report a BUSY outcome)."""


class ReplicaFailed(Exception):
    """The replica broke the request (connection lost, 5xx, stall, ejected): a FAILED outcome."""


@dataclass(frozen=True, slots=True)
class Attempt:
    replica: Replica
    lease: Lease  # held while the request is on this replica


class Attempts:
    """The tries of one request (module docstring). `choose` and `lease` are the two steps a
    caller may make faster (the simulator's index), provided they give the same answers."""

    def __init__(self, config: RouterConfig, pool: ReplicaPool, policy: RoutingPolicy, prefix: str):
        self.config, self.pool, self.policy, self.prefix = config, pool, policy, prefix
        self.tried: list[str] = []  # urls, in the order tried
        self.busy: list[str] = []  # those of them that answered 429

    def next(self) -> Attempt:
        """The next replica to try, its lease taken; raises RouterError when there is none."""
        if len(self.tried) >= self.config.max_attempts:
            raise RouterError(503, f"the request failed on {len(self.tried)} replicas", retry_after_s=1)
        replica = self.choose()
        self.tried.append(replica.url)
        return Attempt(replica, self.lease(replica))

    def choose(self) -> Replica:
        cap = self.config.max_outstanding_per_replica
        candidates = [r for r in self.pool.routable(self.tried) if not r.saturated(cap)]
        if not candidates:
            status = 429 if self.pool.routable() else 503
            raise RouterError(status, "no replica can take the request now; retry later", retry_after_s=1)
        return self.policy.choose(candidates, self.prefix)

    def lease(self, replica: Replica) -> Lease:
        return replica.lease()

    def settle(self, attempt: Attempt, outcome: Outcome) -> bool:
        """Record what the replica answered; True when it accepted (the lease stays held)."""
        if outcome is Outcome.ACCEPTED:
            return True
        attempt.lease.release()
        if outcome is Outcome.FAILED:
            self.pool.record_failure(attempt.replica)
        else:
            self.busy.append(attempt.replica.url)
        return False

    def forget_busy(self) -> None:
        """The replicas that were busy may be tried again (and count no more against max_attempts)."""
        self.tried = [url for url in self.tried if url not in self.busy]
        self.busy = []

    def succeeded(self, attempt: Attempt) -> None:
        self.pool.record_success(attempt.replica)


def first_accepting(attempts: Attempts, send: Callable[[Replica], Outcome]) -> Attempt:
    """The retry loop, synchronous (the simulator's; Forwarder.send is the same loop around HTTP
    sends): try replicas until one accepts; raises RouterError when none will. An exception from
    `send` releases the attempt's lease and propagates (it is no replica's failure)."""
    while True:
        attempt = attempts.next()
        try:
            outcome = send(attempt.replica)
        except BaseException:
            attempt.lease.release()
            raise
        if attempts.settle(attempt, outcome):
            return attempt
