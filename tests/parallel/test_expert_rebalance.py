"""Expert placement: the balancing algorithm on its own, and rebalancing a running
expert-parallel replica (real ranks) on a skewed workload."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardserve.parallel.expert import ExpertLoadReport, balanced_placement, initial_placement, rank_loads

SCRIPT = Path(__file__).with_name("rebalance_json.py")


def test_initial_placement_is_contiguous_with_neighbour_replicas():
    assert initial_placement(8, 2, 0) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert initial_placement(8, 2, 1) == ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))


def test_balanced_placement_replicates_the_hot_expert_and_evens_ranks():
    loads = [100.0, 10, 10, 10, 10, 10, 10, 10]  # expert 0 takes 100 of 170 tokens
    placement = balanced_placement(loads, num_ranks=2, slots_per_rank=5)
    held = sorted(e for slots in placement for e in slots)
    assert held.count(0) == 2 and sorted(set(held)) == list(range(8))
    assert all(0 in slots for slots in placement)  # one replica of the hot expert per rank
    # hand computation: the spare slots hold a second copy of expert 0 (50 tokens each) and of
    # expert 1 (5 each); each rank gets 50 + 3 x 10 + 5 = 85. Contiguous, no replicas: 130 / 40.
    assert rank_loads(placement, loads) == [85.0, 85.0]
    assert rank_loads(initial_placement(8, 2, 0), loads) == [130.0, 40.0]


def test_load_report_adds_ep_ranks_and_takes_one_tp_rank():
    ep = ExpertLoadReport.from_ranks([{0: ([1, 2], 5, True)}, {0: ([3, 0], 7, True)}])
    assert ep.routed == {0: [4, 2]} and ep.processed == {0: [5, 7]}
    assert abs(ep.imbalance(0) - 7 / 6) < 1e-12
    tp = ExpertLoadReport.from_ranks([{0: ([1, 2], 6, False)}, {0: ([1, 2], 6, False)}])
    assert tp.routed == {0: [1, 2]} and tp.imbalance(0) == 1.0


def test_rebalancing_a_running_replica_evens_expert_load_and_keeps_outputs(tiny_checkpoints):
    model = str(tiny_checkpoints["mixtral"])
    runs = {}
    for ep in (1, 2):
        proc = subprocess.run([sys.executable, str(SCRIPT), model, "--ep", str(ep)],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[ep] = json.loads(proc.stdout.strip().splitlines()[-1])
    single, parallel = runs[1], runs[2]
    assert parallel["tokens_before"] == parallel["tokens_after"] == single["tokens_before"]
    for layer, before in parallel["imbalance_before"].items():
        after = parallel["imbalance_after"][layer]
        print(f"layer {layer}: max/mean expert load per rank {before:.3f} -> {after:.3f}")
        assert after < before
