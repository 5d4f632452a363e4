"""Fleet mode: several models with traffic forecasts onto a mixed pool of devices, at least cost.

Each (model, device type, layout) is an option with a per-replica capacity (the highest arrival
rate one replica serves within the model's SLO, from ReplicaModel) and a price per hour. The
allocation is an integer program over x_j = replicas of option j:

    minimise    sum_j price_j x_j                       price_j = gpus_j * device price per hour
    subject to  sum_{j of model m} capacity_j x_j >= qps_m        every model's traffic is served
                sum_{j on device d} gpus_j x_j   <= pool_d        no more devices than the pool has
                x_j integer >= 0

solved with scipy.optimize.milp (HiGHS). Capacities add up because a router can split a model's
traffic over its replicas in proportion to their capacities; a replica's capacity is assumed not
to depend on what else runs in the pool (no shared links between replicas).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardserve.bench.stats import SLO, parse_slo
from shardserve.config import ConfigError, ModelConfig
from shardserve.planner.cost_model import Deployment
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import Hardware
from shardserve.planner.replica_model import ReplicaModel, ReplicaPrediction, Workload
from shardserve.planner.search import SearchSpace, candidate_layouts, check_context_fits, kv_capacity_seqs, layout_label


@dataclass(frozen=True)
class FleetDemand:
    """One model to serve: its traffic forecast and SLO."""

    name: str
    model: ModelConfig
    workload: Workload
    slo: SLO


@dataclass(frozen=True)
class PoolDevice:
    hardware: Hardware
    efficiency: Efficiency
    count: int


@dataclass(frozen=True)
class FleetOption:
    """Replicas of demand `demand_index` on device type `hardware` with one layout."""

    demand_index: int
    hardware: str
    layout: str
    gpus_per_replica: int
    capacity_qps: float
    price_per_replica_hour: float
    replica: ReplicaModel | None = field(default=None, compare=False, repr=False)  # for its latency


@dataclass(frozen=True)
class FleetAssignment:
    """`replicas` of one option, taking `qps` of its demand's traffic: the demand's rate split
    over its assignments in proportion to the capacity each brings."""

    demand: str
    option: FleetOption
    replicas: int
    qps: float = math.nan

    @property
    def gpus(self) -> int:
        return self.replicas * self.option.gpus_per_replica

    def prediction(self) -> ReplicaPrediction | None:
        """One replica's latency at its share of the traffic (None without a replica model)."""
        replica = self.option.replica
        return None if replica is None else replica.predict(self.qps / self.replicas)


@dataclass(frozen=True)
class FleetPlan:
    """The cheapest allocation, or feasible=False with the solver's reason in `message`."""

    feasible: bool
    message: str
    assignments: tuple[FleetAssignment, ...] = ()
    cost_per_hour_usd: float = math.nan
    gpus_used: tuple[tuple[str, int, int], ...] = ()  # (device, used, in pool)


def _without_dominated(options: list[FleetOption]) -> list[FleetOption]:
    # an option with at least as many GPUs and no more capacity never helps
    return [o for o in options if not any(
        p is not o and p.gpus_per_replica <= o.gpus_per_replica and p.capacity_qps >= o.capacity_qps
        and (p.gpus_per_replica, -p.capacity_qps) < (o.gpus_per_replica, -o.capacity_qps)
        for p in options)]


def fleet_options(demands: list[FleetDemand], pool: list[PoolDevice], dtype: str,
                  space: SearchSpace = SearchSpace()) -> list[FleetOption]:
    """Every layout of every demand on every pool device that meets the demand's SLO at some load,
    less those another option of the same device beats on both GPUs and capacity."""
    options: list[FleetOption] = []
    for index, demand in enumerate(demands):
        wl = demand.workload
        check_context_fits(demand.model, wl)
        for device in pool:
            found = []
            for par in candidate_layouts(demand.model, device.hardware, space.max_nodes_per_replica):
                try:
                    dep = Deployment(demand.model, par, device.hardware, dtype, device.efficiency)
                    kv_seqs = kv_capacity_seqs(dep, wl, space)
                    if kv_seqs < 1:
                        continue
                    replica = ReplicaModel(dep, wl.input_len, wl.output_len, kv_seqs, space.max_num_batched_tokens,
                                           wl.arrival_cv2)
                    capacity = replica.capacity_qps(demand.slo, tail=space.slo_at_p99)
                except ConfigError:
                    continue
                if capacity > 0:
                    found.append(FleetOption(
                        index, device.hardware.name, layout_label(par),
                        par.world_size, capacity, par.world_size * device.hardware.price_per_hour_usd, replica))
            options.extend(_without_dominated(found))
    return options


def solve_allocation(options: list[FleetOption], demand_qps: list[float],
                     pool_counts: dict[str, int]) -> tuple[list[int], str] | None:
    """Replicas per option minimising cost (ties: fewest GPUs), or None when the pool cannot
    serve every demand. Returns (counts, solver message)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    if not options:
        return None
    devices = sorted(pool_counts)
    gpus = np.array([o.gpus_per_replica for o in options], dtype=float)
    cost = np.array([o.price_per_replica_hour for o in options]) + 1e-6 * gpus
    serve = np.zeros((len(demand_qps), len(options)))
    use = np.zeros((len(devices), len(options)))
    for j, option in enumerate(options):
        serve[option.demand_index, j] = option.capacity_qps
        use[devices.index(option.hardware), j] = option.gpus_per_replica
    upper = np.array([pool_counts[o.hardware] // o.gpus_per_replica for o in options], dtype=float)
    constraints = [LinearConstraint(serve, lb=np.array(demand_qps, dtype=float), ub=np.inf),
                   LinearConstraint(use, lb=0, ub=np.array([pool_counts[d] for d in devices], dtype=float))]
    result = milp(cost, constraints=constraints, integrality=np.ones(len(options)), bounds=Bounds(0, upper))
    if result.status != 0 or result.x is None:
        return None
    return [int(round(v)) for v in result.x], str(result.message)


def plan_fleet(demands: list[FleetDemand], pool: list[PoolDevice], dtype: str = "bfloat16",
               space: SearchSpace = SearchSpace()) -> FleetPlan:
    """The least-cost allocation of `demands` onto `pool` (see the module docstring)."""
    names = [d.hardware.name for d in pool]
    if len(set(names)) != len(names):
        raise ConfigError("fleet pool: a device type is listed twice")
    options = fleet_options(demands, pool, dtype, space)
    served = {o.demand_index for o in options}
    unservable = [d.name for i, d in enumerate(demands) if i not in served]
    if unservable:
        return FleetPlan(False, f"no device in the pool can meet the SLO of: {', '.join(unservable)}")
    pool_counts = {d.hardware.name: d.count for d in pool}
    solved = solve_allocation(options, [d.workload.qps for d in demands], pool_counts)
    if solved is None:
        return FleetPlan(False, "the pool is too small for the forecast traffic under these SLOs")
    counts, message = solved
    brought = {}  # capacity each demand's assignments bring, to split its traffic by
    for o, n in zip(options, counts):
        brought[o.demand_index] = brought.get(o.demand_index, 0.0) + n * o.capacity_qps
    assignments = tuple(
        FleetAssignment(demands[o.demand_index].name, o, n,
                        demands[o.demand_index].workload.qps * n * o.capacity_qps / brought[o.demand_index])
        for o, n in zip(options, counts) if n)
    used = {name: 0 for name in names}
    for a in assignments:
        used[a.option.hardware] += a.gpus
    return FleetPlan(
        True, message, assignments, sum(a.replicas * a.option.price_per_replica_hour for a in assignments),
        tuple((name, used[name], pool_counts[name]) for name in names),
    )


def _demand_from_entry(entry: object, index: int, defaults: dict) -> tuple[str, Workload, SLO]:
    if not isinstance(entry, dict) or "model" not in entry or "qps" not in entry:
        raise ConfigError(f"fleet file: models[{index}] needs at least 'model' and 'qps'")
    slo = entry.get("slo", defaults.get("slo"))
    if isinstance(slo, dict):
        slo = ",".join(f"{k}={v}" for k, v in slo.items())
    try:
        workload = Workload(int(entry.get("isl", defaults.get("isl"))), int(entry.get("osl", defaults.get("osl"))),
                            float(entry["qps"]))
    except (TypeError, ValueError):
        raise ConfigError(f"fleet file: models[{index}] has a missing or non-numeric isl, osl or qps") from None
    return str(entry["model"]), workload, parse_slo(slo) if slo else SLO()


def read_fleet_file(path: str | Path, defaults: dict) -> tuple[list[tuple[str, Workload, SLO]], dict[str, int]]:
    """Parse a fleet YAML file:

        pool: {H100: 16, H200: 8}          # device (catalog name or alias) -> count
        models:
          - {model: llama-3.1-70b, qps: 4, isl: 1024, osl: 256, slo: "ttft_ms=2000,tpot_ms=100"}
          - {model: mixtral-8x7b, qps: 12}  # isl, osl, slo default to the command line's

    Returns ([(model name or path, workload, slo)], {device: count})."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read fleet file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("pool"), dict) or not isinstance(data.get("models"), list):
        raise ConfigError(f"fleet file {path}: expected a 'pool:' mapping and a 'models:' list")
    pool = {}
    for name, count in data["pool"].items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"fleet file {path}: pool count of {name!r} must be a whole number >= 0")
        pool[str(name)] = count
    return [_demand_from_entry(e, i, defaults) for i, e in enumerate(data["models"])], pool
