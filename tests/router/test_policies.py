"""Each routing policy's choice, on Replica records in chosen states (no HTTP)."""
from __future__ import annotations

import random

import pytest

from shardserve.config import ConfigError
from shardserve.router.policies import LeastOutstanding, PowerOfTwo, PrefixAware, RoundRobin, _rendezvous, make_policy
from shardserve.router.replica_pool import LoadSignals, Replica


def fleet(*outstanding: int) -> list[Replica]:
    return [Replica(f"http://r{i}", outstanding=n) for i, n in enumerate(outstanding)]


def test_round_robin_goes_round_in_url_order_whatever_the_candidates_order():
    replicas = fleet(0, 0, 0)
    policy = RoundRobin()
    picks = [policy.choose(random.Random(i).sample(replicas, 3), "").url for i in range(6)]
    assert picks == ["http://r1", "http://r2", "http://r0"] * 2


def test_least_outstanding_takes_the_fewest_in_flight_and_breaks_ties_by_load_then_url():
    replicas = fleet(2, 1, 1)
    policy = LeastOutstanding()
    assert policy.choose(replicas, "").url == "http://r1"  # tie on in-flight and load: by url
    replicas[1].load = LoadSignals(num_waiting=5)
    assert policy.choose(replicas, "").url == "http://r2"  # the replica's own queue breaks the tie
    replicas[0].outstanding, replicas[0].load = 0, LoadSignals(num_waiting=500, kv_usage=0.9)
    assert policy.choose(replicas, "").url == "http://r0"  # fresh in-flight counts before stale load,
    assert PowerOfTwo(seed=1).choose(replicas[:2], "").url == "http://r0"  # however long its queue


def test_power_of_two_is_seeded_and_takes_the_less_loaded_of_its_two():
    replicas = fleet(3, 0, 5, 1)
    a, b = PowerOfTwo(seed=7), PowerOfTwo(seed=7)
    picks = [a.choose(replicas, "").url for _ in range(40)]
    assert picks == [b.choose(replicas, "").url for _ in range(40)]
    rng = random.Random(7)
    for url in picks:
        pair = rng.sample(replicas, 2)
        assert url == min(pair, key=lambda r: (r.outstanding, r.url)).url
    assert "http://r2" not in picks  # the most loaded loses every pair it is in
    assert PowerOfTwo().choose(replicas[:1], "") is replicas[0]


def test_prefix_aware_sends_a_prefix_to_the_same_replica_and_spreads_prefixes():
    replicas = fleet(0, 0, 0, 0)
    policy = PrefixAware(prefix_chars=8, slack=1.25)
    first = policy.choose(replicas, "system: you are helpful")
    assert all(policy.choose(replicas, "system: you are helpful").url == first.url for _ in range(5))
    assert policy.choose(replicas, "system: something else").url == first.url  # only 8 characters count
    assert len({policy.choose(replicas, f"prompt {i}").url for i in range(40)}) == 4


def test_rendezvous_moves_only_the_prefixes_of_a_replica_that_leaves():
    replicas = fleet(0, 0, 0, 0)
    policy = PrefixAware(prefix_chars=64, slack=1.25)
    prefixes = [f"conversation {i}" for i in range(200)]
    before = {p: policy.choose(replicas, p).url for p in prefixes}
    after = {p: policy.choose(replicas[:2] + replicas[3:], p).url for p in prefixes}
    moved = {p for p in prefixes if before[p] != after[p]}
    assert moved == {p for p in prefixes if before[p] == "http://r2"} and moved


def test_prefix_aware_falls_back_in_hash_order_past_the_load_bound():
    replicas = fleet(0, 0, 0)
    policy = PrefixAware(prefix_chars=64, slack=1.25)
    ranked = sorted(replicas, key=lambda r: _rendezvous("shared prompt", r.url), reverse=True)
    ranked[0].outstanding = 1  # mean 1/3: bound 1.25 x 1/3 + 1 = 1.42, 1 is within it
    assert policy.choose(replicas, "shared prompt") is ranked[0]
    ranked[0].outstanding = 2  # bound 1.83: the preferred one is over it, the next in its hash order takes it
    assert policy.choose(replicas, "shared prompt") is ranked[1]


def test_an_unknown_policy_is_a_config_error():
    assert isinstance(make_policy("power_of_two"), PowerOfTwo)
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
