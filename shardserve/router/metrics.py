"""The router's own Prometheus metrics (one registry per router)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardserve.router.replica_pool import ReplicaPool, ReplicaState

_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    def __init__(self, policy: str):
        r = self.registry = CollectorRegistry()
        self.policy = policy
        self.requests = Counter("shardserve_router_requests", "Requests by the replica that finished them and outcome",
                                ["replica", "outcome"], registry=r)
        self.retries = Counter("shardserve_router_retries", "Requests sent again after a replica failed before "
                               "streaming anything", ["replica"], registry=r)
        self.migrations = Counter("shardserve_router_migrations", "Streams resumed on another replica after this "
                                  "one failed mid-stream", ["replica"], registry=r)
        self.rejected = Counter("shardserve_router_rejected", "Requests answered 429 or 503 by the router",
                                ["reason"], registry=r)
        self.decisions = Counter("shardserve_router_routing_decisions", "Replica chosen by the policy",
                                 ["policy", "replica"], registry=r)
        self.ejections = Gauge("shardserve_router_ejections", "Times the replica was ejected", ["replica"], registry=r)
        self.outstanding = Gauge("shardserve_router_outstanding", "Requests in flight to the replica", ["replica"], registry=r)
        self.state = Gauge("shardserve_router_replica_state", "1 for the replica's current state", ["replica", "state"],
                           registry=r)
        self.added_latency = Histogram("shardserve_router_added_latency_seconds", "Time the router adds before a "
                                       "request leaves for its replica", buckets=_BUCKETS_S, registry=r)

    def render(self, pool: ReplicaPool) -> bytes:
        for url, replica in pool.replicas.items():
            self.outstanding.labels(url).set(replica.outstanding)
            self.ejections.labels(url).set(pool.num_ejections.get(url, 0))
            for state in ReplicaState:
                self.state.labels(url, state.value).set(1.0 if replica.state is state else 0.0)
        return generate_latest(self.registry)
