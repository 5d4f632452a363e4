"""`shardserve bench`: load-test an OpenAI-compatible server at one or more load levels.

    shardserve bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --input-len 128 --output-len 128
    shardserve bench --base-url http://127.0.0.1:8080 --request-rate 2,4,8 --burstiness 0.5 \
        --dataset sharegpt --slo ttft_ms=500,tpot_ms=50 --extra-body '{"cache_prompt": false}'

Every level runs the same prompt and output lengths (same seed); rate levels also differ in their
arrival times. Synthetic prompts get fresh token ids per level, so a level cannot hit the prefix
cache that the previous level filled (a jsonl trace's prompts are what they are). Prints a table per level (and a summary across levels), writes JSON and PNGs on
request. Mistakes a user can fix raise ConfigError, which the CLI prints as one line.

Scripts call `run_benchmark` / `run_benchmark_sync` (re-exported here from `bench.client`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path

from shardserve.bench.client import BenchClientError, run_benchmark, run_benchmark_sync
from shardserve.bench.stats import SLO, BenchResult, LatencySummary, LoadLevel, parse_slo
from shardserve.config import ConfigError
from shardserve.sim.workload import RequestSpec, WorkloadConfig, build_workload

__all__ = ["add_bench_parser", "run_bench_command", "run_benchmark", "run_benchmark_sync", "BenchClientError"]


def add_bench_parser(subparsers) -> None:
    """Register the `bench` subcommand on an argparse subparsers object (func=run_bench_command)."""
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    add_workload_args(p)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on each request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_command)


def add_workload_args(p) -> None:
    """The flags that say what load to offer and how to report it (shared with `shardserve simulate`)."""
    p.add_argument("--num-requests", type=int, default=64, help="requests per load level")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed loop: comma list of worker counts, one run each, e.g. 1,8,32 (default 1)")
    load.add_argument("--request-rate", default=None,
                      help="open loop: comma list of request rates in req/s, one run each ('inf': all at once; "
                           "'trace': a jsonl trace's own arrival times)")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: at most this many in flight")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="open loop: gamma shape of the inter-arrival gaps (1 = Poisson, < 1 burstier)")
    p.add_argument("--dataset", default="random", help="random | sharegpt (synthetic ShareGPT-like lengths) | jsonl:PATH")
    p.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="random dataset: output tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths uniform in len*(1 +- r)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed; rerunning a seed against the same server may hit its prefix cache")
    p.add_argument("--slo", default=None, help="goodput targets, e.g. ttft_ms=500,tpot_ms=50 (also e2e_ms)")
    p.add_argument("--result-json", default=None, help="write the results (with per-request records) here")
    p.add_argument("--plot-dir", default=None, help="write latency CDF and load-sweep PNGs here")


def _parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency: expected a comma list of integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency: every level must be an integer >= 1, got {text!r}")
    return levels


def _parse_rates(text: str, dataset: str) -> list[float | None]:
    """Rates in req/s; None stands for 'trace' (the trace's own arrival times)."""
    rates: list[float | None] = []
    for raw in (v.strip() for v in text.split(",") if v.strip()):
        if raw == "trace":
            if not dataset.startswith("jsonl:"):
                raise ConfigError("--request-rate trace needs --dataset jsonl:PATH")
            rates.append(None)
            continue
        try:
            rate = float(raw)
        except ValueError:
            raise ConfigError(f"--request-rate: {raw!r} is not a number, 'inf' or 'trace'") from None
        if not rate > 0:
            raise ConfigError(f"--request-rate: rates must be > 0, got {raw}")
        rates.append(rate)
    if not rates:
        raise ConfigError("--request-rate: give at least one rate")
    return rates


def _parse_extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-body: not valid JSON ({exc.msg})") from None
    if not isinstance(body, dict):
        raise ConfigError("--extra-body: must be a JSON object")
    return body


def check_workload_args(args: argparse.Namespace) -> None:
    """ConfigError (one line) on workload flags that cannot make a run."""
    checks = [
        (args.num_requests >= 1, f"--num-requests must be >= 1, got {args.num_requests}"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len and --output-len must be >= 1"),
        (0 <= args.range_ratio < 1, f"--range-ratio must be in [0, 1), got {args.range_ratio}"),
        (0 < args.burstiness < math.inf, f"--burstiness must be > 0, got {args.burstiness}"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.max_concurrency is None or args.concurrency is None,
         "--max-concurrency caps an open loop; with --concurrency the level is the cap"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_args(args: argparse.Namespace) -> None:
    check_workload_args(args)
    if not 0 < args.timeout_s < math.inf:
        raise ConfigError(f"--timeout-s must be > 0, got {args.timeout_s}")


def level_configs(args: argparse.Namespace) -> list[tuple[LoadLevel, WorkloadConfig]]:
    """Each load level the flags ask for, with the WorkloadConfig of its requests (a closed loop's
    requests are all sent at 0: callers zero a jsonl trace's own arrival times)."""
    base = WorkloadConfig(num_requests=args.num_requests, dataset=args.dataset, input_len=args.input_len,
                          output_len=args.output_len, range_ratio=args.range_ratio,
                          burstiness=args.burstiness, seed=args.seed)
    if args.request_rate is None:
        return [(LoadLevel(concurrency=c), dataclasses.replace(base, prompt_salt=salt))
                for salt, c in enumerate(_parse_concurrency(args.concurrency or "1"))]
    return [(LoadLevel(args.max_concurrency, rate, args.burstiness),
             dataclasses.replace(base, request_rate_qps=rate, prompt_salt=salt))
            for salt, rate in enumerate(_parse_rates(args.request_rate, args.dataset))]


def _levels_and_workloads(args: argparse.Namespace) -> list[tuple[LoadLevel, list[RequestSpec]]]:
    try:
        plans = []
        for level, config in level_configs(args):
            workload = build_workload(config)
            if args.request_rate is None:  # a closed loop ignores arrival times (a jsonl trace may carry some)
                workload = [dataclasses.replace(s, arrival_time_s=0.0) for s in workload]
            plans.append((level, workload))
        return plans
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--dataset: {exc}") from None


def run_bench_command(args: argparse.Namespace) -> int:
    """Run every load level, print tables, write JSON / plots. Returns 0, or 1 if no request
    succeeded at any level. Raises ConfigError (one-line message) on bad flags or an unreachable server."""
    _check_args(args)
    slo = parse_slo(args.slo) if args.slo else None
    extra_body = _parse_extra_body(args.extra_body)
    plans = _levels_and_workloads(args)
    if len(plans[0][1]) < args.num_requests:
        print(f"note: the trace holds {len(plans[0][1])} requests, fewer than --num-requests", file=sys.stderr)
    results = []
    for level, specs in plans:
        result = asyncio.run(run_benchmark(
            args.base_url, specs, level.concurrency, model=args.model, level=level, slo=slo,
            ignore_eos=not args.no_ignore_eos, temperature=args.temperature, timeout_s=args.timeout_s,
            show_progress=not args.no_progress, extra_body=extra_body))
        print(format_result(result), flush=True)
        results.append(result)
    return finish_report(args, results, "bench")


def finish_report(args: argparse.Namespace, results: list[BenchResult], command: str) -> int:
    """The summary over load levels, the output files, and the exit code (1: nothing succeeded);
    shared with `shardserve simulate`, so both reports end alike."""
    if len(results) > 1:
        print(format_summary(results))
    write_outputs(args, results)
    if not any(r.num_ok for r in results):
        print(f"shardserve {command}: no request succeeded", file=sys.stderr)
        return 1
    return 0


def write_outputs(args: argparse.Namespace, results: list[BenchResult]) -> None:
    """--result-json and --plot-dir, when given (also `shardserve simulate`'s)."""
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "func"}
        path.write_text(json.dumps({"config": config, "results": [r.to_dict() for r in results]}, indent=2))
        print(f"results written to {path}")
    if args.plot_dir:
        from shardserve.bench.plots import write_plots  # matplotlib is slow to import; only when asked

        for path in write_plots(results, args.plot_dir):
            print(f"plot written to {path}")


def _latency_row(name: str, s: LatencySummary) -> str:
    return f"  {name:<6}{s.mean_ms:>10.1f}{s.p50_ms:>10.1f}{s.p90_ms:>10.1f}{s.p99_ms:>10.1f}{s.count:>11}"


def _slo_text(slo: SLO) -> str:
    terms = [f"{k}<={v:g}" for k, v in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms), ("e2e_ms", slo.e2e_ms))
             if v is not None]
    return ", ".join(terms)


def format_result(result: BenchResult) -> str:
    """A readable table of one load level."""
    lines = [
        f"=== {result.level.label}: {result.num_requests} requests in {result.wall_time_s:.2f} s ===",
        f"requests      ok {result.num_ok}   failed {result.num_failed}   of which 429 {result.num_rate_limited}",
        f"throughput    {result.request_throughput_qps:.2f} req/s   {result.output_throughput_tok_s:.1f} output tok/s"
        f"   ({result.total_output_tokens} output tokens)",
    ]
    if result.slo is not None:
        lines.append(f"goodput       {result.goodput_qps:.2f} req/s meeting {_slo_text(result.slo)}")
    lines.append(f"  {'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>11}")
    lines += [_latency_row(n, getattr(result, n.lower())) for n in ("TTFT", "TPOT", "ITL", "E2E")]
    if any(r.ok and not r.tokens_from_usage for r in result.records):
        lines.append("note: the server sent no usage for some requests; their tokens were counted as chunks")
    lines += [f"error: {e}" for e in result.error_samples]
    return "\n".join(lines)


def format_summary(results: list[BenchResult]) -> str:
    """One line per load level, for comparing levels at a glance."""
    header = (f"{'level':<34}{'ok':>5}{'fail':>5}{'429':>5}{'req/s':>8}{'tok/s':>9}"
              f"{'TTFT p50/p99':>16}{'TPOT p50/p99':>16}{'goodput':>9}")
    rows = [header]
    for r in results:
        goodput = "-" if r.goodput_qps is None else f"{r.goodput_qps:.2f}"
        rows.append(f"{r.level.label:<34}{r.num_ok:>5}{r.num_failed:>5}{r.num_rate_limited:>5}"
                    f"{r.request_throughput_qps:>8.2f}{r.output_throughput_tok_s:>9.1f}"
                    f"{r.ttft.p50_ms:>8.1f}/{r.ttft.p99_ms:<7.1f}{r.tpot.p50_ms:>8.1f}/{r.tpot.p99_ms:<7.1f}{goodput:>9}")
    return "=== summary (latencies in ms) ===\n" + "\n".join(rows)
