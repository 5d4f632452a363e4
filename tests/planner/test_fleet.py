"""Fleet allocation: the MILP against exhaustive search on a small case, and the end-to-end path."""
from __future__ import annotations

import itertools
import math

import pytest

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.fleet import (
    FleetDemand, FleetOption, PoolDevice, plan_fleet, read_fleet_file, solve_allocation,
)
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.planner.plan_report import format_fleet
from shardserve.planner.replica_model import Workload
from shardserve.planner.search import SearchSpace

# Device A: $1 per GPU-hour, 4 in the pool; device B: $3, 10 in the pool.
OPTIONS = [
    FleetOption(0, "A", "tp1", gpus_per_replica=1, capacity_qps=3.0, price_per_replica_hour=1.0),
    FleetOption(0, "B", "tp1", gpus_per_replica=1, capacity_qps=5.0, price_per_replica_hour=3.0),
    FleetOption(1, "A", "tp2", gpus_per_replica=2, capacity_qps=2.0, price_per_replica_hour=2.0),
    FleetOption(1, "B", "tp1", gpus_per_replica=1, capacity_qps=1.0, price_per_replica_hour=3.0),
]
POOL = {"A": 4, "B": 10}


def _brute_force(demand_qps):
    best = (math.inf, None)
    bounds = [range(POOL[o.hardware] // o.gpus_per_replica + 1) for o in OPTIONS]
    for counts in itertools.product(*bounds):
        for dev, size in POOL.items():
            if sum(n * o.gpus_per_replica for n, o in zip(counts, OPTIONS) if o.hardware == dev) > size:
                break
        else:
            served = [sum(n * o.capacity_qps for n, o in zip(counts, OPTIONS) if o.demand_index == d)
                      for d in range(len(demand_qps))]
            if all(s >= q for s, q in zip(served, demand_qps)):
                cost = sum(n * o.price_per_replica_hour for n, o in zip(counts, OPTIONS))
                best = min(best, (cost, counts))
    return best


@pytest.mark.parametrize("demand_qps", [[10.0, 4.0], [3.0, 2.0], [20.0, 1.0], [0.5, 6.0]])
def test_milp_matches_exhaustive_search(demand_qps):
    counts, _ = solve_allocation(OPTIONS, demand_qps, POOL)
    cost = sum(n * o.price_per_replica_hour for n, o in zip(counts, OPTIONS))
    assert cost == pytest.approx(_brute_force(demand_qps)[0])


def test_known_optimum_by_hand():
    # model 0 needs 10 req/s, model 1 needs 4. The 4 A GPUs can give model 0 12 req/s for $4
    # (model 1 then needs 4 B replicas, $12: $16 in all) or give model 1 its 4 req/s for $4
    # (model 0 then needs 2 B replicas, $6: $10). Mixes cost more: 2 A for each model leaves
    # model 0 one B ($3) and model 1 two B ($6), $13. The optimum is $10.
    counts, _ = solve_allocation(OPTIONS, [10.0, 4.0], POOL)
    assert counts == [0, 2, 2, 0]


def test_too_small_a_pool_is_infeasible():
    assert solve_allocation(OPTIONS, [100.0, 4.0], POOL) is None


def test_plan_fleet_end_to_end_respects_pool_and_traffic():
    slo = SLO(ttft_ms=2000, tpot_ms=100)
    demands = [FleetDemand("llama-3.1-8b", preset("llama-3.1-8b"), Workload(1024, 256, 12.0), slo),
               FleetDemand("mixtral-8x7b", preset("mixtral-8x7b"), Workload(1024, 256, 3.0), slo)]
    pool = [PoolDevice(get_hardware("h100"), Efficiency(), 8), PoolDevice(get_hardware("h200"), Efficiency(), 2)]
    one_node = SearchSpace(max_nodes_per_replica=1)  # keeps the test quick
    plan = plan_fleet(demands, pool, space=one_node)
    assert plan.feasible
    for name, used, size in plan.gpus_used:
        assert used <= size
    for index, demand in enumerate(demands):
        mine = [a for a in plan.assignments if a.demand == demand.name]
        assert sum(a.replicas * a.option.capacity_qps for a in mine) >= demand.workload.qps
        # each assignment's share of the traffic, and its latency there, within the SLO
        assert sum(a.qps for a in mine) == pytest.approx(demand.workload.qps)
        for a in mine:
            pred = a.prediction()
            assert pred.arrival_qps == pytest.approx(a.qps / a.replicas) and pred.meets(slo)
    assert "TTFT ms" in format_fleet(plan) and "TPOT ms" in format_fleet(plan)
    # no H200 in the pool: everything lands on H100s and costs at least as much
    h100_only = plan_fleet(demands, [pool[0], PoolDevice(get_hardware("h200"), Efficiency(), 0)], space=one_node)
    assert h100_only.feasible and all(a.option.hardware == "H100 SXM" for a in h100_only.assignments)
    assert h100_only.cost_per_hour_usd >= plan.cost_per_hour_usd - 1e-6
    tiny = plan_fleet(demands, [PoolDevice(get_hardware("h100"), Efficiency(), 1)], space=one_node)
    assert not tiny.feasible


def test_read_fleet_file(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("pool: {H100: 8, H200: 2}\nmodels:\n"
                    "  - {model: llama-3.1-8b, qps: 4, isl: 512, slo: {ttft_ms: 1000}}\n"
                    "  - {model: mixtral-8x7b, qps: 2}\n")
    entries, pool = read_fleet_file(path, {"isl": 1024, "osl": 256, "slo": "tpot_ms=50"})
    assert pool == {"H100": 8, "H200": 2}
    assert entries[0] == ("llama-3.1-8b", Workload(512, 256, 4.0), SLO(ttft_ms=1000))
    assert entries[1] == ("mixtral-8x7b", Workload(1024, 256, 2.0), SLO(tpot_ms=50))
    path.write_text("pool: {H100: -1}\nmodels: []\n")
    with pytest.raises(ConfigError, match="whole number"):
        read_fleet_file(path, {})
    path.write_text("models: []\n")
    with pytest.raises(ConfigError, match="pool"):
        read_fleet_file(path, {})
