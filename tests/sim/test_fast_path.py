"""The simulator's fast path (decode runs, the hidden decode group, mixed steps) against plain
stepping of the real Scheduler one step at a time: the same step times to the bit, the same token
times for every request, and the same Scheduler and BlockManager state, across workloads that
exercise chunked prefill, preemption, prefix-cache hits and evictions, the sequence cap, the context
window, closed loops and a routed fleet."""
from __future__ import annotations

import pytest

from shardserve.bench.stats import LoadLevel
from shardserve.config import RouterConfig
from shardserve.sim.simulation import ServingOverheads, Simulation
from tests.sim.sim_helpers import config, shared_prefix_specs

SCENARIOS = {
    # name: (config kwargs, number of requests, rate, cap on concurrency)
    "chunked_prefill": (dict(max_num_batched_tokens=96), 150, 40.0, None),
    "preemption": (dict(num_kv_blocks=80, max_model_len=1024), 150, 60.0, None),
    "few_seqs": (dict(max_num_seqs=3, max_num_batched_tokens=256), 100, 30.0, None),
    "context_window": (dict(max_model_len=320), 120, 25.0, None),
    "no_prefix_caching": (dict(prefix_caching=False, num_kv_blocks=120, max_model_len=1024), 120, 50.0, None),
    "closed_loop": (dict(num_kv_blocks=200, max_model_len=1024, overheads=ServingOverheads(0.002, 0.001)), 120, None, 12),
    "fleet": (dict(replicas=3, policy="power_of_two", num_kv_blocks=150, max_model_len=1024), 200, 90.0, None),
    "fleet_least_outstanding": (dict(replicas=4, num_kv_blocks=300, max_model_len=1024,
                                     router=RouterConfig(max_outstanding_per_replica=6)), 200, 120.0, None),
}


def snapshot(sim: Simulation) -> list[dict]:
    """Everything stepping leaves behind, per replica."""
    states = []
    for replica in sim.replicas:
        bm, scheduler = replica.blocks, replica.scheduler
        states.append(dict(
            step_end_s=list(replica.step_end_s),
            blocks=[(b.block_id, b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
            free_front=list(bm._free_front), free_back=list(bm._free_back), cached=dict(bm.cached),
            prefix_counters=(bm.num_prefix_queries, bm.num_prefix_hits), preemptions=scheduler.num_preemptions,
            queues=([r.req_id for r in scheduler.waiting], [r.req_id for r in scheduler.running]),
        ))
    return states


def run_both(name: str):
    kwargs, num, rate, cap = SCENARIOS[name]
    outcomes = []
    for fast in (False, True):
        sim = Simulation(config(fast_path=fast, **kwargs))
        results, states = [], []
        for level_index in range(2):  # two levels: the second starts from what the first left
            specs = shared_prefix_specs(num, rate or 1.0, seed=level_index, max_prompt_len=700)
            if rate is None:
                specs = [s.__class__(s.prompt_token_ids, None, s.output_len, 0.0) for s in specs]
            results.append(sim.run_level(LoadLevel(cap, rate), specs))
            states.append(snapshot(sim))
        outcomes.append((sim, results, states))
    return outcomes


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fast_path_is_identical_to_plain_stepping(name):
    (plain_sim, plain_results, plain_states), (fast_sim, fast_results, fast_states) = run_both(name)
    for plain, fast in zip(plain_results, fast_results):
        assert fast.records == plain.records  # every token's time, to the bit
        assert fast.to_dict(include_requests=False) == plain.to_dict(include_requests=False)
        assert fast.num_ok > 0
    assert fast_states == plain_states
    assert all(r.num_steps_by_kind["run"] == r.num_steps_by_kind["mixed"] == 0 for r in plain_sim.replicas)
    kinds = {k: sum(r.num_steps_by_kind[k] for r in fast_sim.replicas) for k in ("run", "mixed", "plain")}
    assert kinds["run"] > 0 and kinds["mixed"] > 0  # the fast path did the work
    if name == "preemption":
        assert kinds["plain"] > 0 and sum(r.scheduler.num_preemptions for r in fast_sim.replicas) > 0
    if name != "no_prefix_caching":
        assert sum(r.blocks.num_prefix_hits for r in fast_sim.replicas) > 0


def test_decode_runs_take_most_steps_at_once():
    """The point of the fast path: on a decode-heavy load most steps come in runs."""
    sim = Simulation(config())
    sim.run_level(LoadLevel(None, 10.0), shared_prefix_specs(100, 10.0, max_prompt_len=300, max_output_len=400))
    kinds = sim.replicas[0].num_steps_by_kind
    assert kinds["run"] > 4 * (kinds["mixed"] + kinds["plain"])


def test_decode_runs_stop_where_the_free_blocks_run_out():
    """The group's count of the blocks a run of steps takes, against stepping's own count."""
    from shardserve.config import SchedulerConfig
    from shardserve.engine.block_manager import BlockManager
    from shardserve.engine.scheduler import Scheduler
    from shardserve.sim.decode_group import DecodeGroup

    group = DecodeGroup(Scheduler(SchedulerConfig(), BlockManager(64, 16), 1024), 0)
    group.size = 5  # members in three buckets (only counted here, never replayed)
    group.buckets[0], group.buckets[3], group.buckets[15] = [None, None], [None], [None, None]
    steps_taking = [len(group.buckets[-s % 16]) for s in range(100, 200)]  # blocks stepping takes per step
    for free in (0, 1, 2, 3, 4, 5, 7, 11, 23, 40):
        steps = group.max_steps_within(100, 100, free)
        assert sum(steps_taking[:steps]) <= free
        assert steps == 100 or sum(steps_taking[:steps + 1]) > free
