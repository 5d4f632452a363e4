"""Routing policies: pick a replica for a request among the routable ones. One interface,
chosen by name (`--policy`)."""
from __future__ import annotations

import hashlib
import random
from typing import Protocol

from shardserve.router.replica_pool import Replica


class RoutingPolicy(Protocol):
    def choose(self, candidates: list[Replica], prefix: str) -> Replica:
        """`candidates` is non-empty; `prefix` is the start of the request's prompt text."""


class RoundRobin:
    def __init__(self) -> None:
        self.counter = 0

    def choose(self, candidates: list[Replica], prefix: str) -> Replica:
        ordered = sorted(candidates, key=lambda r: r.url)
        self.counter += 1
        return ordered[self.counter % len(ordered)]


class LeastOutstanding:
    def choose(self, candidates: list[Replica], prefix: str) -> Replica:
        return min(candidates, key=lambda r: (r.score(), r.url))


class PowerOfTwo:
    """Two replicas at random, the less loaded of them: near least-loaded balance without every
    router instance piling onto the same replica."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, candidates: list[Replica], prefix: str) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        return a if (a.score(), a.url) <= (b.score(), b.url) else b


class PrefixAware:
    """Requests whose prompts start alike go to the same replica, whose prefix cache likely holds
    that start: rendezvous hashing of the prompt's first `prefix_chars` characters over the
    replicas (stable as replicas come and go). Bounded by load: if the preferred replica has more
    than `slack` x the mean in flight (+1), take the next one in its hash order that is not, so a
    shared system prompt cannot pile every request on one replica."""

    def __init__(self, prefix_chars: int, slack: float) -> None:
        self.prefix_chars, self.slack = prefix_chars, slack

    def choose(self, candidates: list[Replica], prefix: str) -> Replica:
        key = prefix[: self.prefix_chars]
        ranked = sorted(candidates, key=lambda r: _rendezvous(key, r.url), reverse=True)
        limit = self.slack * sum(r.outstanding for r in candidates) / len(candidates) + 1
        return next((r for r in ranked if r.outstanding <= limit), min(candidates, key=lambda r: r.score()))


def _rendezvous(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}|{key}".encode(), digest_size=8).digest(), "big")


def make_policy(name: str, prefix_chars: int = 256, slack: float = 1.25) -> RoutingPolicy:
    factories = {
        "round_robin": RoundRobin,
        "least_outstanding": LeastOutstanding,
        "power_of_two": PowerOfTwo,
        "prefix_aware": lambda: PrefixAware(prefix_chars, slack),
    }
    if name not in factories:
        from shardserve.config import ConfigError

        raise ConfigError(f"unknown routing policy {name!r}; choose one of {', '.join(factories)}")
    return factories[name]()
