"""The autoscaler's decisions, without processes: bands, hysteresis, stability window, cooldown,
bounds."""
from __future__ import annotations

from shardserve.cluster.autoscaler import AutoscaleState, GroupLoad, decide
from shardserve.cluster.config import AutoscaleConfig

POLICY = AutoscaleConfig(min_replicas=1, max_replicas=4, scale_up_waiting_per_replica=4.0,
                         scale_down_waiting_per_replica=0.5, kv_usage_high=0.85, kv_usage_low=0.5,
                         cooldown_s=30.0, scale_down_stable_s=60.0)
IDLE = GroupLoad(num_replicas=2, num_waiting=0.0, kv_usage=0.1)


def test_a_long_queue_grows_the_group_enough_to_drain_it():
    load = GroupLoad(num_replicas=2, num_waiting=14.0, kv_usage=0.3)  # 7 per replica
    decision = decide(POLICY, load, current=2, state=AutoscaleState(), now_s=100.0)
    assert decision.target == 4  # ceil(14 / 4): back under 4 waiting per replica
    assert decision.state.last_change_s == 100.0


def test_growth_is_at_least_one_and_at_most_max():
    slightly = GroupLoad(num_replicas=2, num_waiting=9.0, kv_usage=0.3)  # 4.5 per replica; ceil(9/4) = 3
    assert decide(POLICY, slightly, 2, AutoscaleState(), 0.0).target == 3
    flood = GroupLoad(num_replicas=2, num_waiting=400.0, kv_usage=0.3)
    assert decide(POLICY, flood, 2, AutoscaleState(), 0.0).target == 4
    at_max = decide(POLICY, flood, 4, AutoscaleState(), 0.0)
    assert at_max.target == 4 and "at max" in at_max.reason


def test_a_full_kv_cache_grows_the_group_even_without_a_queue():
    load = GroupLoad(num_replicas=2, num_waiting=0.0, kv_usage=0.9)
    assert decide(POLICY, load, 2, AutoscaleState(), 0.0).target == 3


def test_no_change_within_the_cooldown():
    load = GroupLoad(num_replicas=3, num_waiting=30.0, kv_usage=0.3)
    state = AutoscaleState(last_change_s=90.0)
    assert decide(POLICY, load, 3, state, now_s=100.0).target == 3  # 10 s after the last change
    assert decide(POLICY, load, 3, state, now_s=121.0).target == 4


def test_between_the_bands_the_group_holds():
    """Hysteresis: 2 waiting per replica is neither high (4) nor low (0.5)."""
    load = GroupLoad(num_replicas=3, num_waiting=6.0, kv_usage=0.6)
    decision = decide(POLICY, load, 3, AutoscaleState(low_since_s=10.0), now_s=1000.0)
    assert decision.target == 3 and decision.state.low_since_s is None


def test_shrinking_needs_low_load_held_for_the_stability_window():
    state = AutoscaleState()
    for now_s in (100.0, 130.0, 159.0):  # low since 100: not yet 60 s
        decision = decide(POLICY, IDLE, 2, state, now_s)
        assert decision.target == 2
        state = decision.state
    assert state.low_since_s == 100.0
    decision = decide(POLICY, IDLE, 2, state, 160.0)
    assert decision.target == 1 and decision.state == AutoscaleState(last_change_s=160.0, low_since_s=None)


def test_a_burst_in_the_window_restarts_it():
    state = decide(POLICY, IDLE, 2, AutoscaleState(), 100.0).state
    busy = GroupLoad(num_replicas=2, num_waiting=4.0, kv_usage=0.3)  # in the band: resets low_since
    state = decide(POLICY, busy, 2, state, 140.0).state
    state = decide(POLICY, IDLE, 2, state, 150.0).state
    assert decide(POLICY, IDLE, 2, state, 200.0).target == 2  # only 50 s low since the burst
    assert decide(POLICY, IDLE, 2, state, 210.0).target == 1


def test_shrinking_is_one_at_a_time_and_stops_at_min():
    state = AutoscaleState(low_since_s=0.0)
    decision = decide(POLICY, GroupLoad(4, 0.0, 0.0), 4, state, 1000.0)
    assert decision.target == 3
    # the next step needs its own quiet window (and the cooldown)
    assert decide(POLICY, GroupLoad(3, 0.0, 0.0), 3, decision.state, 1001.0).target == 3
    assert decide(POLICY, GroupLoad(1, 0.0, 0.0), 1, AutoscaleState(low_since_s=0.0), 1000.0).target == 1


def test_without_signals_nothing_changes_but_bounds_still_apply():
    none = GroupLoad(num_replicas=0, num_waiting=0.0, kv_usage=0.0)
    assert decide(POLICY, none, 2, AutoscaleState(), 0.0).target == 2
    assert decide(POLICY, none, 9, AutoscaleState(), 0.0).target == 4
    assert decide(POLICY, none, 0, AutoscaleState(), 0.0).target == 1
