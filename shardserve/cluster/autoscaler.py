"""How many replicas a group should have, from its load: a pure function, so every rule can be
tested without processes, and the supervisor applies the answer.

    waiting per replica  ----------+---------------------+----------------->
                          shrink   |   hold (hysteresis) |  grow
                        (if held   down                  up
                         stable_s)

    grow:   waiting/replica > up  or  mean KV usage > kv_high
    shrink: waiting/replica <= down and mean KV usage < kv_low, continuously for
            scale_down_stable_s (a dip between bursts must not cost a replica)
    after any change, nothing for cooldown_s (the new replica needs time to start and take load)

Growth jumps to the count that brings the queue back under `up` (at least +1): a replica takes
seconds to minutes to start, so adding one at a time under a burst would lag for minutes.
Shrinking removes one at a time: each removal drains a replica, and load moves to the others.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardserve.cluster.config import AutoscaleConfig


@dataclass(frozen=True)
class GroupLoad:
    """What the router last scraped from the group's serving replicas."""

    num_replicas: int  # serving and healthy: the ones whose signals are summed here
    num_waiting: float  # sum of vllm:num_requests_waiting
    kv_usage: float  # mean of vllm:kv_cache_usage_perc, 0..1


@dataclass(frozen=True)
class AutoscaleState:
    last_change_s: float = -math.inf
    low_since_s: float | None = None  # when the load last entered the shrink band


@dataclass(frozen=True)
class ScaleDecision:
    target: int
    reason: str  # why the target is what it is; logged when it changes
    state: AutoscaleState


def decide(policy: AutoscaleConfig, load: GroupLoad, current: int, state: AutoscaleState,
           now_s: float) -> ScaleDecision:
    """The target replica count for a group whose target is now `current`."""
    bounded = min(policy.max_replicas, max(policy.min_replicas, current))
    if bounded != current:
        return ScaleDecision(bounded, "outside min/max", dataclasses.replace(state, last_change_s=now_s))
    if load.num_replicas == 0:  # nothing serving yet (or all unhealthy): no signal, no change
        return ScaleDecision(current, "no load signals", state)
    waiting_per_replica = load.num_waiting / load.num_replicas
    cooling = now_s - state.last_change_s < policy.cooldown_s
    signals = f"{waiting_per_replica:.1f} waiting/replica, kv {load.kv_usage:.0%}"
    if waiting_per_replica > policy.scale_up_waiting_per_replica or load.kv_usage > policy.kv_usage_high:
        state = dataclasses.replace(state, low_since_s=None)
        if cooling or current >= policy.max_replicas:
            return ScaleDecision(current, f"high load ({signals}) but {'cooling down' if cooling else 'at max'}", state)
        enough = math.ceil(load.num_waiting / policy.scale_up_waiting_per_replica)
        target = min(policy.max_replicas, max(current + 1, enough))
        return ScaleDecision(target, f"high load ({signals})", dataclasses.replace(state, last_change_s=now_s))
    if waiting_per_replica <= policy.scale_down_waiting_per_replica and load.kv_usage < policy.kv_usage_low:
        low_since_s = now_s if state.low_since_s is None else state.low_since_s
        state = dataclasses.replace(state, low_since_s=low_since_s)
        if current > policy.min_replicas and not cooling and now_s - low_since_s >= policy.scale_down_stable_s:
            # the next step down needs its own quiet period
            return ScaleDecision(current - 1, f"low load ({signals}) for {now_s - low_since_s:.0f} s",
                                 AutoscaleState(last_change_s=now_s, low_since_s=None))
        return ScaleDecision(current, f"low load ({signals})", state)
    return ScaleDecision(current, f"within the hysteresis band ({signals})",
                         dataclasses.replace(state, low_since_s=None))
