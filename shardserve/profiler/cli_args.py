"""`shardserve profile`: profile a model on the real engine and calibrate the planner's cost model.

    shardserve profile smollm2 --quick --out prof/          # < 1 minute on a 2-core CPU
    shardserve profile ./Llama-3.1-8B --dtype bfloat16 --tp 2 --out prof/
    shardserve plan --model smollm2 --hardware "this host" --dtype float32 --calibration prof/calibration.json

Writes DIR/profile.csv (one row per profiled step), DIR/roofline.png and DIR/calibration.json
(format: planner/efficiency.py), prints a table, the prefill and decode bottlenecks and the
fit's error. docs/profiling.md explains the method.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_profile_parser(subparsers) -> None:
    """Register the `profile` subcommand on an argparse subparsers object (func=run_profile_command)."""
    from shardserve.engine.cli_args import add_engine_args

    p = subparsers.add_parser("profile", help="profile a model on the engine: op-class split, MFU/MBU, "
                                              "bottlenecks, and a calibration for plan/simulate")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    add_engine_args(p)
    p.add_argument("--out", default="profile", metavar="DIR", help="output folder (created; default ./profile)")
    p.add_argument("--quick", action="store_true", help="a small sweep (< 1 minute for SmolLM2 on a CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per sweep point (median counts)")
    p.add_argument("--device-name", default=None, metavar="NAME",
                   help="use this catalog device's peaks (e.g. H100) instead of measuring this host")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the profiled requests (default greedy, as benchmarks replay)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    import dataclasses

    from shardserve.engine.cli_args import engine_kwargs
    from shardserve.config import ConfigError
    from shardserve.llm import engine_config_from_kwargs
    from shardserve.models.checkpoint import load_checkpoint
    from shardserve.profiler.profile_run import ProfileConfig, calibration_json, describe_efficiency, run_profile
    from shardserve.profiler.report import bottleneck_line, format_table, prefill_split_line, write_csv
    from shardserve.profiler.roofline_plot import write_roofline_plot
    from shardserve.profiler.sweep import FULL_SWEEP, QUICK_SWEEP

    if args.repeats is not None and args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    model_name = args.model_pos or args.model
    config = engine_config_from_kwargs(model_name, **engine_kwargs(args), show_progress=not args.no_progress)
    model = load_checkpoint(config.model).config
    config.parallel.validate(model)
    sweep = QUICK_SWEEP if args.quick else FULL_SWEEP
    if args.repeats is not None:
        sweep = dataclasses.replace(sweep, num_repeats=args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _warn_if_busy()
    result = run_profile(config, model, ProfileConfig(sweep, args.device_name, args.temperature,
                                                      show_progress=not args.no_progress))
    dep = result.deployment
    peak, bandwidth = dep.hardware.peak_flop_s_for(dep.dtype), dep.hardware.memory_bandwidth_bytes_s
    paths = {"csv": out / "profile.csv", "roofline": out / "roofline.png", "calibration": out / "calibration.json"}
    write_csv(result.rows, paths["csv"])
    write_roofline_plot(result.rows, peak, bandwidth, paths["roofline"],
                        f"{model_name} ({dep.dtype}) on {result.device_name}")
    paths["calibration"].write_text(json.dumps(calibration_json(result), indent=2) + "\n")
    print(f"profile: {model_name}, {dep.dtype}, tp{dep.parallel.tp_size} pp{dep.parallel.pp_size} "
          f"ep{dep.parallel.ep_size}, on {result.device_name}: peak {peak / 1e9:.1f} GFLOP/s, "
          f"{bandwidth / 1e9:.1f} GB/s")
    print(format_table(result.rows))
    for kind in ("prefill", "decode", "mixed"):
        line = bottleneck_line(kind, result.rows)
        if line:
            print("bottleneck " + line)
    split = prefill_split_line(result.rows, peak)
    if split:
        print(split)
    fit = result.fit
    by_kind = ", ".join(f"{kind} {error:.1%}" for kind, error in fit.mape_by_kind.items())
    print(f"calibration: {describe_efficiency(dep.efficiency)}")
    print(f"calibration fit: step-time MAPE {fit.mape:.1%} over {fit.num_samples} steps ({by_kind}); "
          f"uncalibrated priors {result.prior_mape:.0%}")
    noisy = [r.measurement.point.label for r in result.rows
             if max(r.measurement.totals_s) > _NOISY_SPREAD * min(r.measurement.totals_s)]
    if noisy:
        print(f"warning: {len(noisy)} of {len(result.rows)} steps varied by more than {_NOISY_SPREAD}x over their "
              f"timed repeats ({', '.join(noisy[:4])}{', ...' if len(noisy) > 4 else ''}): is something else "
              "running? The medians count, but a quiet host calibrates better.")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


_NOISY_SPREAD = 1.5


def _warn_if_busy() -> None:
    """Other processes on the cores make step times noisy; on a small CPU host an OpenMP
    parallel region whose thread lost its core waits for it, so one busy neighbour can slow
    steps several times over. Say so before spending the time."""
    import os
    import sys

    load, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * num_cpus:
        print(f"warning: the 1-minute load average is {load:.1f} on {num_cpus} CPUs; other work on this host "
              "will make the profile noisy", file=sys.stderr)
