"""Simulator speed: a thousand replicas, a million requests, on one core of this host.

The fleet: 1,000 replicas of Llama-3.1-8B in bfloat16 on H100 (the catalog's figures, uncalibrated
priors: speed does not depend on them), each running the engine's Scheduler and BlockManager with
`shardserve serve`'s defaults, behind the router's least-outstanding policy. The load: bench's
default workload (random prompts of 128 tokens, 128 output tokens) for 1,000,000 requests, Poisson
at 20,000 req/s in all (20 per replica; about 17 sequences decode on a replica at once).

Prefix caching is off by default here, and why: with it on, the real BlockManager keeps every
finished request's blocks, tokens included, findable until the pool wraps around, which for this
fleet is up to 400k tokens per replica, 400M in all: gigabytes of Python objects. Random prompts
never hit the cache, so the simulated times are the same either way (tests/sim/test_fast_path.py
checks that on a small fleet); `--prefix-caching` runs it on (use fewer requests).

Run
    .venv/bin/python benchmarks/sim_speed.py [--num-requests N] [--replicas R] [--prefix-caching]
    Prints the simulated bench report, then `RESULT {"wall_s", "num_replicas", "num_requests",
    "target_s", "within_target", "us_per_request", ...}` (also benchmarks/results/sim_speed.json).
    Target: wall_s < 120 for the default size.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TARGET_S = 120.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=1_000_000)
    parser.add_argument("--rate-per-replica", type=float, default=20.0, help="req/s offered to each replica")
    parser.add_argument("--policy", default="least_outstanding")
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()

    start = time.perf_counter()
    from shardserve.bench.cli_args import format_result
    from shardserve.bench.stats import LoadLevel
    from shardserve.config import ParallelConfig, RouterConfig, SchedulerConfig
    from shardserve.planner.model_presets import preset
    from shardserve.sim.fleet_setup import engine_num_kv_blocks, resolve_deployment
    from shardserve.sim.replica import ReplicaSetup
    from shardserve.sim.simulation import SimConfig, Simulation
    from shardserve.sim.workload import WorkloadConfig, iter_workload

    deployment = resolve_deployment(preset("llama-3.1-8b"), "H100", "bfloat16", ParallelConfig())
    max_model_len = 8192
    setup = ReplicaSetup(SchedulerConfig(), engine_num_kv_blocks(deployment, 16, max_model_len), 16,
                         args.prefix_caching, max_model_len)
    config = SimConfig(deployment, setup, args.replicas, args.policy, RouterConfig(policy=args.policy))
    rate = args.rate_per_replica * args.replicas
    workload = WorkloadConfig(num_requests=args.num_requests, input_len=128, output_len=128, request_rate_qps=rate)
    sim = Simulation(config)
    result = sim.run_level(LoadLevel(None, rate), iter_workload(workload))
    wall_s = time.perf_counter() - start

    kinds = {k: sum(r.num_steps_by_kind[k] for r in sim.replicas) for k in ("run", "mixed", "plain")}
    print(format_result(result))
    print(f"{args.replicas} replicas, {args.num_requests} requests: {wall_s:.1f} s of wall time for "
          f"{result.wall_time_s:.1f} s simulated; {sum(kinds.values())} engine steps ({kinds})")
    summary = {
        "wall_s": round(wall_s, 2), "num_replicas": args.replicas, "num_requests": args.num_requests,
        "target_s": TARGET_S, "within_target": wall_s < TARGET_S,
        "us_per_request": round(wall_s / args.num_requests * 1e6, 1), "simulated_s": round(result.wall_time_s, 2),
        "num_steps": sum(kinds.values()), "steps_by_kind": kinds, "prefix_caching": args.prefix_caching,
        "policy": args.policy, "num_ok": result.num_ok, "ttft_p50_ms": round(result.ttft.p50_ms, 2),
        "tpot_p50_ms": round(result.tpot.p50_ms, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_speed.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
