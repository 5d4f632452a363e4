"""`shardserve simulate`: `shardserve bench`'s run, on a simulated router and replicas.

    shardserve simulate --model smollm2 --hardware this-host --calibration cal.json --dtype bfloat16 \
        --request-rate 2,4 --num-requests 200 --input-len 256 --range-ratio 0.5 --output-len 64
    shardserve simulate --model llama-3.1-8b --hardware H100 --replicas 1000 --policy least_outstanding \
        --request-rate 20000 --num-requests 1000000 --no-prefix-caching

Takes bench's workload flags (the same requests, seed for seed), the engine's scheduler and KV
flags (the same defaults as `shardserve serve`), a device and a parallel layout; prints bench's
report per level. Every replica runs the engine's own Scheduler and BlockManager; step times come
from the cost model, calibrated by `--calibration` or else from priors (the header says which).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from shardserve.dtypes import ALL_DTYPES

DEFAULT_POLICY = "least_outstanding"


def add_simulate_parser(subparsers) -> None:
    """Register the `simulate` subcommand on an argparse subparsers object (func=run_simulate_command)."""
    from shardserve.bench.cli_args import add_workload_args

    p = subparsers.add_parser("simulate", help="simulate a router and replicas under a bench workload")
    p.add_argument("--model", default="smollm2", help="preset (llama-3.1-8b, ...), HF folder, .gguf or 'smollm2'")
    p.add_argument("--hardware", default="this-host",
                   help="catalog device (H100, ...) or this-host (as --calibration recorded it, else measured now)")
    p.add_argument("--calibration", default=None, help="efficiency factors from `shardserve profile` (JSON)")
    p.add_argument("--dtype", default="bfloat16", choices=ALL_DTYPES)
    p.add_argument("--replicas", type=int, default=1, help="replicas behind the router")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help="round_robin | least_outstanding | power_of_two | prefix_aware")
    p.add_argument("--router", action="store_true",
                   help="put the router in front of a single replica too (default: only for --replicas > 1)")
    p.add_argument("--max-outstanding-per-replica", type=int, default=64, help="the router's saturation point")
    par = p.add_argument_group("parallel layout of each replica")
    par.add_argument("--tp", type=int, default=1)
    par.add_argument("--pp", type=int, default=1)
    par.add_argument("--ep", type=int, default=1)
    eng = p.add_argument_group("engine and server (defaults as `shardserve serve`)")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes per rank")
    eng.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                     help="of the memory free after the weights (default 0.85 on an accelerator, 0.1 on a CPU host)")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--max-num-seqs", type=int, default=128)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="default: as `shardserve serve` on the device (512 on a CPU host, else 2048)")
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--max-waiting-requests", type=int, default=256, help="unscheduled requests beyond this get 429")
    srv = p.add_argument_group("serving overheads (benchmarks/sim_accuracy.py measures them against a server)")
    srv.add_argument("--request-delay-ms", type=float, default=0.0,
                     help="from the client sending a request to the engine holding it")
    srv.add_argument("--token-delay-ms", type=float, default=0.0,
                     help="from the end of the step that sampled a token to the client reading it")
    srv.add_argument("--decode-step-scale", type=float, default=1.0,
                     help="a serving replica's decode step time over the profiled engine's (above 1 on a CPU host)")
    srv.add_argument("--prompt-step-scale", type=float, default=1.0,
                     help="the same for steps that prefill a prompt")
    srv.add_argument("--step-seq-ms", type=float, default=0.0,
                     help="serving time added to a step per sequence in it (streaming its token; above 0 on a CPU host)")
    add_workload_args(p)
    p.set_defaults(func=run_simulate_command)


def build_sim_config(args: argparse.Namespace):
    """The SimConfig the flags describe (resolves the model, device, calibration and KV blocks)."""
    from shardserve.config import ConfigError, ParallelConfig, RouterConfig, SchedulerConfig, serving_token_budget
    from shardserve.planner.model_presets import resolve_model
    from shardserve.router.policies import make_policy
    from shardserve.sim.fleet_setup import engine_num_kv_blocks, is_cpu_host, resolve_deployment
    from shardserve.sim.replica import ReplicaSetup
    from shardserve.sim.simulation import ServingOverheads, SimConfig

    for flag, value in (("--replicas", args.replicas), ("--block-size", args.block_size),
                        ("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--max-waiting-requests", args.max_waiting_requests),
                        ("--max-outstanding-per-replica", args.max_outstanding_per_replica)):
        if value is not None and value < 1:  # None: the default, resolved below
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if (min(args.request_delay_ms, args.token_delay_ms, args.step_seq_ms) < 0
            or min(args.decode_step_scale, args.prompt_step_scale) <= 0):
        raise ConfigError("--request-delay-ms, --token-delay-ms and --step-seq-ms must be >= 0, the step scales > 0")
    make_policy(args.policy)  # an unknown policy fails here, in one line
    model = resolve_model(args.model)
    parallel = ParallelConfig(tp_size=args.tp, pp_size=args.pp, ep_size=args.ep)
    deployment = resolve_deployment(model, args.hardware, args.dtype, parallel, args.calibration)
    max_model_len = args.max_model_len or model.max_position_embeddings
    num_blocks = engine_num_kv_blocks(deployment, args.block_size, max_model_len, args.kv_cache_memory,
                                      args.kv_cache_memory_fraction)
    budget = args.max_num_batched_tokens or serving_token_budget(is_cpu_host(deployment.hardware))
    setup = ReplicaSetup(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs),
        num_kv_blocks=num_blocks, block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=max_model_len, max_waiting_requests=args.max_waiting_requests)
    router = None
    if args.replicas > 1 or args.router:
        router = RouterConfig(policy=args.policy, max_outstanding_per_replica=args.max_outstanding_per_replica)
    overheads = ServingOverheads(request_s=args.request_delay_ms / 1e3, token_s=args.token_delay_ms / 1e3,
                                 decode_step_scale=args.decode_step_scale, prompt_step_scale=args.prompt_step_scale,
                                 step_seq_s=args.step_seq_ms / 1e3)
    return SimConfig(deployment=deployment, setup=setup, num_replicas=args.replicas, policy=args.policy,
                     router=router, overheads=overheads)


def describe(config) -> str:
    """Two lines: what is simulated, and whether its step times are calibrated."""
    dep, setup = config.deployment, config.setup
    par = dep.parallel
    front = f"router ({config.policy})" if config.router else "no router"
    cache = "prefix caching" if setup.enable_prefix_caching else "no prefix caching"
    return (f"simulate: {config.num_replicas} x {dep.hardware.name} tp{par.tp_size} pp{par.pp_size} ep{par.ep_size}, "
            f"{dep.dtype}, {front}; {setup.num_kv_blocks} KV blocks of {setup.block_size} per replica, {cache}, "
            f"max_num_seqs {setup.scheduler.max_num_seqs}, max_num_batched_tokens "
            f"{setup.scheduler.max_num_batched_tokens}\n"
            f"step times: cost model, {dep.efficiency.label}"
            + _scales(config.overheads))


def _scales(overheads) -> str:
    text = ""
    if not overheads.decode_step_scale == overheads.prompt_step_scale == 1:
        text += (f"; serving scales decode steps x{overheads.decode_step_scale:g}, "
                 f"prompt steps x{overheads.prompt_step_scale:g}")
    if overheads.step_seq_s:
        text += f"; serving adds {overheads.step_seq_s * 1e3:g} ms per sequence in a step"
    return text


def run_simulate_command(args: argparse.Namespace) -> int:
    """Simulate every load level, print bench's tables, write JSON / plots. Returns 0, or 1 if no
    request succeeded at any level; ConfigError (one line) on bad flags."""
    from shardserve.bench.cli_args import check_workload_args, finish_report, format_result, level_configs
    from shardserve.bench.stats import parse_slo
    from shardserve.config import ConfigError
    from shardserve.sim.simulation import Simulation
    from shardserve.sim.workload import build_workload, iter_workload

    check_workload_args(args)
    slo = parse_slo(args.slo) if args.slo else None
    config = build_sim_config(args)
    print(describe(config), flush=True)
    if not config.deployment.efficiency.calibrated:
        print(f"  (uncalibrated: literature priors, {config.deployment.efficiency.priors_text()}; pass --calibration FILE"
              " from `shardserve profile`)")
    sim = Simulation(config)
    results = []
    for level, workload in level_configs(args):
        closed_loop = args.request_rate is None
        start = time.perf_counter()
        try:
            # a trace is read whole (its arrivals may come in any order); synthetic requests are drawn as needed
            specs = build_workload(workload) if workload.dataset.startswith("jsonl:") else iter_workload(workload)
            if closed_loop:  # a closed loop ignores arrival times (a jsonl trace may carry some)
                specs = (dataclasses.replace(s, arrival_time_s=0.0) for s in specs)
            result = sim.run_level(level, specs, slo)
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"--dataset: {exc}") from None
        print(format_result(result))
        print(f"(simulated in {time.perf_counter() - start:.2f} s)", flush=True)
        results.append(result)
    return finish_report(args, results, "simulate")
