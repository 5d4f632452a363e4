"""`shardserve plan`: the cheapest deployments of a model for a traffic level under latency SLOs.

    shardserve plan --model llama-3.1-70b --hardware H100,H200 --isl 1024 --osl 256 --qps 10 \
        --slo ttft_ms=2000,tpot_ms=100 --json plan.json --plot plan.png
    shardserve plan --model mixtral-8x7b --hardware H100 --qps 5 --what-if mem_bw=2x,flops=1.5x
    shardserve plan --fleet fleet.yaml                  # several models onto a device pool (MILP)

Prints a ranked table (and, for Poisson traffic, the cheapest disaggregated prefill + decode
pools against it: planner/disaggregation.py); exits 1 when no deployment meets the SLO (or the pool is too small), 2 on
bad input (one line). Predictions are the analytic cost model's means, "uncalibrated" unless
`--calibration FILE` (the profiler's efficiency factors) covers the device; docs/planning.md.
"""
from __future__ import annotations

import argparse
import time

from shardserve.dtypes import ALL_DTYPES

DEFAULT_SLO = "ttft_ms=2000,tpot_ms=200"  # MLPerf's Llama-2-70B server targets (p99 there, means here)


def add_plan_parser(subparsers) -> None:
    """Register the `plan` subcommand on an argparse subparsers object (func=run_plan_command)."""
    p = subparsers.add_parser("plan", help="plan deployments: parallel layout x replicas x hardware, by cost")
    p.add_argument("--model", default=None,
                   help="preset (e.g. llama-3.1-70b, deepseek-v3, qwen3-235b-a22b; `shardserve plan --model x` "
                        "lists them), HF folder or .gguf")
    p.add_argument("--hardware", default=None, help="comma list of catalog devices, e.g. H100,H200,MI300X "
                                                    "(or a profiled host named in --calibration, e.g. 'this host')")
    p.add_argument("--isl", type=int, default=1024, help="mean prompt length in tokens")
    p.add_argument("--osl", type=int, default=256, help="mean output length in tokens")
    p.add_argument("--qps", type=float, default=None, help="arrival rate to serve, requests/s (Poisson)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="instead of --qps: clients per replica in a closed loop, as serving benchmarks run")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals (as `shardserve bench --burstiness`): 1 Poisson, <1 burstier")
    p.add_argument("--slo", default=DEFAULT_SLO, help=f"latency targets (default {DEFAULT_SLO}; also e2e_ms)")
    p.add_argument("--slo-percentile", default="mean", choices=["mean", "p99"],
                   help="what the SLO bounds: the predicted means, or the p99 estimates")
    p.add_argument("--dtype", default="bfloat16", choices=ALL_DTYPES,
                   help="weights and KV cache dtype")
    p.add_argument("--what-if", default=None, help="plan on modified devices, e.g. mem_bw=2x,flops=1.5x,memory=1.5x,"
                                                   "price=0.8x (also intra_bw, inter_bw, power)")
    p.add_argument("--rank-by", default="cost", choices=["cost", "gpus"], help="order of the table")
    p.add_argument("--max-gpus", type=int, default=None, help="GPU budget for the whole deployment")
    p.add_argument("--max-nodes-per-replica", type=int, default=2, help="largest replica, in nodes")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's per-step token budget")
    p.add_argument("--calibration", default=None, help="efficiency factors measured by the profiler (JSON)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--json", default=None, metavar="OUT", help="write the plan as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write the cost vs latency Pareto plot")
    p.add_argument("--fleet", default=None, metavar="FILE.yaml",
                   help="allocate several models onto a device pool (see shardserve/planner/fleet.py)")
    p.set_defaults(func=run_plan_command)


def _devices(names: list[str], what_if: str | None, calibration_path: str | None, dtype: str | None = None):
    """[(Hardware, Efficiency)] for catalog names; calibration matched on the unmodified device
    and on `dtype` (factors fitted in another dtype do not apply)."""
    from shardserve.planner.efficiency import Efficiency, load_calibration
    from shardserve.planner.hardware import apply_what_if, get_hardware, load_catalog

    catalog = load_catalog()
    calibration = load_calibration(calibration_path) if calibration_path else None
    devices, seen = [], set()
    for name in names:
        # a profiled host (not in the catalog) is planned on the peaks its calibration recorded
        measured = calibration.hardware_for(name) if calibration else None
        hw = measured if measured is not None else get_hardware(name, catalog)
        if hw.name in seen:
            continue
        seen.add(hw.name)
        eff = calibration.for_device(hw.name, hw.aliases, dtype) if calibration else Efficiency()
        devices.append((apply_what_if(hw, what_if) if what_if else hw, eff))
    return devices


def _efficiency_line(devices) -> str:
    labels = [f"{hw.name}: {eff.label}" for hw, eff in devices]
    line = "efficiency: " + "; ".join(labels)
    prior = next((eff for _, eff in devices if not eff.calibrated), None)
    if prior is not None:
        line += (f"\n  (uncalibrated = literature priors: {prior.priors_text()}; pass --calibration FILE"
                 " from `shardserve profile`)")
    return line


def _split_names(text: str | None, flag: str) -> list[str]:
    from shardserve.config import ConfigError

    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{flag} needs at least one name")
    return names


def run_plan_command(args: argparse.Namespace) -> int:
    from shardserve.bench.stats import parse_slo
    from shardserve.config import ConfigError
    from shardserve.planner.model_presets import resolve_model
    from shardserve.planner.plan_report import format_plan
    from shardserve.planner.replica_model import Workload
    from shardserve.planner.search import SearchSpace, search

    for flag, value in (("--max-gpus", args.max_gpus), ("--max-nodes-per-replica", args.max_nodes_per_replica),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    space = SearchSpace(max_nodes_per_replica=args.max_nodes_per_replica, max_total_gpus=args.max_gpus,
                        max_num_batched_tokens=args.max_num_batched_tokens, slo_at_p99=args.slo_percentile == "p99")
    if args.fleet:
        return _run_fleet(args, space)
    if args.model is None or (args.qps is None) == (args.concurrency is None):
        raise ConfigError("plan needs --model and one of --qps and --concurrency (or --fleet FILE)")
    slo = parse_slo(args.slo)
    workload = Workload(args.isl, args.osl, args.qps, args.concurrency, args.burstiness)
    traffic = f"{args.qps:g} req/s" if args.qps is not None else f"{args.concurrency} clients per replica (closed loop)"
    if args.burstiness != 1:
        traffic += f", gamma arrivals (burstiness {args.burstiness:g})"
    devices = _devices(_split_names(args.hardware, "--hardware"), args.what_if, args.calibration, args.dtype)
    model = resolve_model(args.model)
    start = time.perf_counter()
    plan = search(model, devices, workload, slo, args.dtype, space, args.rank_by)
    elapsed_s = time.perf_counter() - start
    kind = f"MoE {model.num_experts} experts top-{model.num_experts_per_token}" if model.is_moe else "dense"
    print(f"plan: {args.model} ({model.num_params / 1e9:.1f}B params, {kind}), {args.dtype}; "
          f"isl {args.isl}, osl {args.osl}, {traffic}; SLO {args.slo} ({args.slo_percentile}s)")
    print(_efficiency_line(devices))
    print(format_plan(plan, args.top, elapsed_s))
    if workload.qps is not None:  # separate prefill and decode pools, against the best co-located row
        from shardserve.planner.disaggregation import compare, plan_disaggregated

        disaggregated = plan_disaggregated(model, devices, workload, slo, args.dtype, space)
        print(compare(disaggregated, plan.best))
    if args.what_if:
        print(_what_if_line(args, model, workload, slo, space, plan))
    _write_outputs(args, plan, model, devices, elapsed_s)
    return 0 if plan.best else 1


def _what_if_line(args, model, workload, slo, space, plan) -> str:
    from shardserve.planner.search import search

    devices = _devices(_split_names(args.hardware, "--hardware"), None, args.calibration, args.dtype)
    base = search(model, devices, workload, slo, args.dtype, space, args.rank_by).best
    new = plan.best

    def describe(row) -> str:  # latency too: a what-if may keep the cost and halve the TPOT
        return "nothing feasible" if row is None else (
            f"{row.hardware} {row.layout} x{row.replicas}, ${row.cost_per_million_tokens:.2f}/1M tok, "
            f"{row.total_gpus} GPUs, TTFT {row.ttft_ms:,.0f} ms, TPOT {row.tpot_ms:.1f} ms")
    return f"what-if {args.what_if}: best {describe(new)}; on today's devices: {describe(base)}"


def _write_outputs(args, plan, model, devices, elapsed_s: float) -> None:
    from shardserve.planner.plan_report import plan_json, write_json, write_pareto_plot

    if args.json:
        meta = {"model": args.model, "num_params": model.num_params, "dtype": args.dtype,
                "workload": {"isl": args.isl, "osl": args.osl, "qps": args.qps, "concurrency": args.concurrency},
                "slo": args.slo,
                "what_if": args.what_if, "rank_by": args.rank_by, "search_s": elapsed_s,
                "efficiency": {hw.name: eff.label for hw, eff in devices},
                "calibrated": all(eff.calibrated for _, eff in devices)}
        write_json(plan_json(plan, meta), args.json)
    if args.plot:
        traffic = f"{args.qps:g} req/s" if args.qps is not None else f"{args.concurrency} clients"
        title = f"{args.model}: isl {args.isl}, osl {args.osl}, {traffic}, SLO {args.slo}"
        write_pareto_plot(plan, args.plot, title)


def _run_fleet(args: argparse.Namespace, space) -> int:
    import dataclasses

    from shardserve.planner.fleet import FleetDemand, PoolDevice, plan_fleet, read_fleet_file
    from shardserve.planner.model_presets import resolve_model
    from shardserve.planner.plan_report import format_fleet, write_json

    entries, pool_counts = read_fleet_file(args.fleet, {"isl": args.isl, "osl": args.osl, "slo": args.slo})
    devices = _devices(list(pool_counts), args.what_if, args.calibration, args.dtype)
    counts = list(pool_counts.values())
    pool = [PoolDevice(hw, eff, count) for (hw, eff), count in zip(devices, counts)]
    if len(pool) != len(pool_counts):
        from shardserve.config import ConfigError

        raise ConfigError(f"fleet file {args.fleet}: a device type is listed twice in the pool")
    demands = [FleetDemand(name, resolve_model(name), workload, slo) for name, workload, slo in entries]
    plan = plan_fleet(demands, pool, args.dtype, space)
    print(f"fleet: {len(demands)} models onto " + ", ".join(f"{d.hardware.name} x{d.count}" for d in pool))
    print(_efficiency_line(devices))
    print(format_fleet(plan))
    if args.json:
        write_json({"feasible": plan.feasible, "message": plan.message,
                    "cost_per_hour_usd": plan.cost_per_hour_usd if plan.feasible else None,
                    "assignments": [{"model": a.demand, "replicas": a.replicas, "gpus": a.gpus,
                                     **dataclasses.asdict(a.option)} for a in plan.assignments],
                    "efficiency": {hw.name: eff.label for hw, eff in devices}}, args.json)
    return 0 if plan.feasible else 1
