"""Simulator accuracy: one trace through a real server and through `shardserve simulate`.

1. Calibrate: `shardserve profile smollm2 --dtype bfloat16 --quick` fits the cost model's factors on
   the engine's own steps (skipped with --calibration FILE; `--dtype float32` profiles and serves
   in float32 throughout, for a CPU without AVX512-BF16).
2. Measure: a real `shardserve serve smollm2 --dtype bfloat16` (the engine's defaults; a fixed KV
   cache size, given to the simulator too) gets one trace at two load levels through bench's client:
   Poisson arrivals, mixed lengths (prompts 192 tokens +-50%, outputs 48 +-50%), the same requests
   `shardserve bench --dataset random --input-len 192 --output-len 48 --range-ratio 0.5
   --request-rate LOW,HIGH` would send, at 0.35 and 0.7 of the server's capacity (a burst of 60
   other requests of the same lengths, all sent at once: the rate it is served at; the simulator
   predicts it too, and its error is reported; --rates overrides). Before the trace, a probe of
   sequential tiny requests measures the HTTP path: the client's TTFT minus the server's own (its
   Prometheus histogram) is the time a request spends outside the engine, split evenly between
   the way in and the first token's way out. Then step probes read the server's step times off
   the client's chunk times and fit them against the calibrated cost model: a scale for
   decode-only steps, one for steps with a prompt, and a cost per sequence in a step (streaming
   its token shares the cores with the engine). These are the simulator's ServingOverheads; none
   of them is fitted to the trace. For the capacity burst the probes are 4 to 24 long streams
   with requests of the workload's lengths joining them; for each level a sample of 40 requests
   of the workload at the level's rate, with its own seed and prompt salt, right before the level
   and another right after it (a shared host's speed drifts by 10-20% within a minute: the two
   bracket the level), so that the fit covers the batch sizes and arrival rate the level runs
   at; it fits the two scales, the per-sequence cost is the capacity probe's.
3. Simulate each level with the calibrated cost model and the delays probed for it.
4. Compare output throughput, TTFT p50/p90 and TPOT p50/p90 per level; relative error
   |simulated - measured| / measured. As a diagnosis, also the ratio of the trace's own step
   times (read off its chunk times) to the step clock's: over the total time of decode-only steps,
   and of steps with a prompt that also carried decodes; and the errors of each level simulated
   again with its scales times those ratios (the speed the level really ran at): what remains
   there is the simulated schedule's own error, the rest the host's drift between probe and level.

Run
    .venv/bin/python benchmarks/sim_accuracy.py [--calibration FILE] [--num-requests N] [--rates R1,R2] [--dtype float32]
    About three minutes on this host. Prints both reports and a comparison table; the last line is
    `RESULT {"median_error": .., "max_error": .., <level>_<metric>_error: ..}` (also
    benchmarks/results/sim_accuracy.json). Target: max_error <= 0.15, median_error <= 0.10. Run it
    alone: the server, the client and the profiler share this host's two cores, and the simulator
    is calibrated for a quiet host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

RESULTS = Path(__file__).parent / "results"
KV_CACHE_BYTES = 1 << 30
WORKLOAD = dict(dataset="random", input_len=192, output_len=48, range_ratio=0.5)
CAPACITY_REQUESTS = 60
METRICS = ("output_tok_s", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
LEVEL_NAMES = ("low", "high")


@dataclass(frozen=True)
class Calibrated:
    """The cost model's calibration file and the dtype it was profiled in (the server runs in it too)."""

    path: Path
    dtype: str


def calibrate(out_dir: Path, dtype: str) -> Path:
    cmd = [sys.executable, "-m", "shardserve.cli", "profile", "smollm2", "--dtype", dtype, "--quantization", "none", "--quick",
           "--out", str(out_dir), "--no-progress"]
    print("calibrating: " + " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"shardserve profile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("calibration")), flush=True)
    return out_dir / "calibration.json"


def sim_config(calibration: Calibrated, request_s: float, token_s: float,
               costs: tuple[float, float, float] = (1.0, 1.0, 0.0)):
    from shardserve.config import ParallelConfig, SchedulerConfig, serving_token_budget
    from shardserve.planner.model_presets import resolve_model
    from shardserve.sim.fleet_setup import engine_num_kv_blocks, resolve_deployment
    from shardserve.sim.replica import ReplicaSetup
    from shardserve.sim.simulation import ServingOverheads, SimConfig

    model = resolve_model("smollm2")
    deployment = resolve_deployment(model, "this-host", calibration.dtype, ParallelConfig(), str(calibration.path))
    max_model_len = model.max_position_embeddings
    num_blocks = engine_num_kv_blocks(deployment, 16, max_model_len, KV_CACHE_BYTES)
    # `shardserve serve` defaults on this host
    setup = ReplicaSetup(SchedulerConfig(max_num_batched_tokens=serving_token_budget(on_cpu=True)), num_blocks, 16, True,
                         max_model_len)
    return SimConfig(deployment, setup, 1, router=None, overheads=ServingOverheads(request_s, token_s, *costs))


def workload(rate_qps: float, level_index: int, num_requests: int):
    from shardserve.sim.workload import WorkloadConfig, build_workload

    # bench gives each level its own prompt salt, so no level hits the prefix cache another filled
    return build_workload(WorkloadConfig(num_requests=num_requests, request_rate_qps=rate_qps,
                                         prompt_salt=level_index, seed=1, **WORKLOAD))


def burst(num_requests: int):
    """The capacity probe's requests: the trace's lengths distribution, its own seed and prompt salt,
    all sent at once."""
    from shardserve.sim.workload import WorkloadConfig, build_workload

    specs = build_workload(WorkloadConfig(num_requests=num_requests, request_rate_qps=1.0, prompt_salt=9, seed=2,
                                          **WORKLOAD))
    return [s.__class__(s.prompt_token_ids, None, s.output_len, 0.0) for s in specs]


def predicted_capacity_qps(config, num_requests: int) -> float:
    """Requests/s the simulated server serves when every request arrives at once."""
    from shardserve.bench.stats import LoadLevel
    from shardserve.sim.simulation import simulate

    result, = simulate(config, [(LoadLevel(None, float("inf")), burst(num_requests))])
    return result.request_throughput_qps


def measured_capacity_qps(base_url: str, num_requests: int) -> float:
    """Requests/s the real server serves when every request arrives at once."""
    from shardserve.bench.client import run_benchmark
    from shardserve.bench.stats import LoadLevel

    result = asyncio.run(run_benchmark(base_url, burst(num_requests), None, level=LoadLevel(None, float("inf")),
                                       show_progress=False))
    return result.request_throughput_qps


def scrape_ttft(base_url: str) -> tuple[float, float]:
    """(sum, count) of the server's engine-side TTFT histogram."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(f"vllm:time_to_first_token_seconds{suffix}"):
                values[suffix] = values.get(suffix, 0.0) + float(line.rsplit(" ", 1)[1])
    return values.get("_sum", 0.0), values.get("_count", 0.0)


def probe_http_delay_s(base_url: str, num: int = 24) -> float:
    """Mean client TTFT minus the server's TTFT, over sequential tiny requests."""
    from shardserve.bench.client import run_benchmark
    from shardserve.sim.workload import RequestSpec

    specs = [RequestSpec(tuple(range(1000 + i, 1008 + i)), None, 2, 0.0) for i in range(num)]
    asyncio.run(run_benchmark(base_url, specs[:4], 1, show_progress=False))  # warm-up
    before = scrape_ttft(base_url)
    result = asyncio.run(run_benchmark(base_url, specs, 1, show_progress=False))
    after = scrape_ttft(base_url)
    server_ttft_s = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return max(0.0, result.ttft.mean_ms / 1e3 - server_ttft_s)


STEP_PROBES = (4, 8, 16, 24)  # long streams per capacity probe
# requests joining each capacity probe (Poisson)
PROBE_ARRIVALS, PROBE_ARRIVAL_QPS = 12, 3.0
LEVEL_PROBE_REQUESTS = 40  # each sample of the workload run before and after a level


def server_steps(records, prompt_lens: dict[int, int]) -> list[tuple[float, int, int, list[tuple[int, int]]]]:
    """The server's steps, read off the client's chunk times: a step's tokens leave together, so
    chunk times cluster by step. Per step after the first: (duration, decodes, their context sum,
    prompt chunks): a request's first chunk marks its prompt's step, the others its decodes."""
    chunks = sorted((t, r.index, k) for r in records for k, t in enumerate(r.chunk_times_s))
    clusters: list[list[tuple[float, int, int]]] = []
    for chunk in chunks:
        if clusters and chunk[0] - clusters[-1][-1][0] < 0.003:
            clusters[-1].append(chunk)
        else:
            clusters.append([chunk])
    steps = []
    for previous, cluster in zip(clusters, clusters[1:]):
        decodes = [(index, k) for _, index, k in cluster if k > 0]
        prompts = [(prompt_lens[index], prompt_lens[index]) for _, index, k in cluster if k == 0]
        context_sum = sum(prompt_lens[index] + k for index, k in decodes)
        steps.append((cluster[0][0] - previous[0][0], len(decodes), context_sum, prompts))
    return steps


def fit_step_costs(decode_steps: list[tuple[int, float, float]], prompt_steps: list[tuple[int, float, float, int]],
                   per_seq_s: float | None = None):
    """(decode scale, prompt scale, seconds per sequence) with measured = scale * model + per_seq * n.
    decode_steps: (sequences in the step, measured s, model s); prompt_steps the same and the
    step's decodes. Decode-only steps are
    grouped by n and each group's means fitted: a request's time per output token sums its steps,
    the host's stalls included (fitted to medians, the simulator missed that tail and put TPOT
    p50 up to 12% low). A decode-only step's time is all engine time; a step with a prompt and no
    decodes may start on an idle server, and the time read off the chunks then holds the idle
    wait; one that carries decodes cannot (the server was busy with them). So the prompt scale is
    fitted on total time over the busy prompt steps, as the decode scale is (a mean: under load
    their long tail is what queues build on; the median of all prompt steps left the high level's
    TTFT p50 19% and TPOT p90 32% low in one run), and is the median over all prompt steps when
    fewer than five were busy. The per-sequence part is taken off first. With `per_seq_s` given,
    only the scales are fitted."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for n, measured_s, model_s in decode_steps:
        groups.setdefault(n, []).append((measured_s, model_s))
    rows = [(n, float(np.mean([m for m, _ in g])), float(np.mean([c for _, c in g])), len(g))
            for n, g in sorted(groups.items()) if len(g) >= 5]
    weights = np.array([count for *_, count in rows], dtype=float)
    model = np.array([c for _, _, c, _ in rows])
    measured = np.array([m for _, m, _, _ in rows])
    sizes = np.array([n for n, *_ in rows], dtype=float)
    decode_scale = None
    if per_seq_s is None and len(rows) >= 3:
        design = np.stack([model, sizes], axis=1) * np.sqrt(weights)[:, None]
        (decode_scale, per_seq_s), *_ = np.linalg.lstsq(design, measured * np.sqrt(weights), rcond=None)
    if per_seq_s is None or per_seq_s < 0:  # too few batch sizes to tell, or no growth with the batch
        per_seq_s, decode_scale = 0.0, None
    if decode_scale is None:  # the scale alone, over what the per-sequence cost leaves
        decode_scale = np.sum(weights * model * (measured - per_seq_s * sizes)) / np.sum(weights * model**2)
    busy = [(n, m, c) for n, m, c, decodes in prompt_steps if decodes > 0]
    if len(busy) >= 5:
        prompt_scale = sum(m - per_seq_s * n for n, m, _ in busy) / sum(c for *_, c in busy)
    else:
        prompt_scale = float(np.median([(m - per_seq_s * n) / c for n, m, c, _ in prompt_steps]))
    return float(decode_scale), float(prompt_scale), float(per_seq_s)


def probe_step_costs(base_url: str, clock) -> tuple[float, float, float]:
    """The step costs at the capacity burst's batch sizes: fit_step_costs over every step the
    client can see (server_steps) while each probe streams 4-24 requests (32-token prompts, 150
    tokens out) and meanwhile sends requests of the workload's length ranges as a Poisson stream.
    Its own seed: none of these requests is in the trace."""
    from shardserve.sim.workload import RequestSpec

    rng = np.random.default_rng(7)
    ratio = WORKLOAD["range_ratio"]
    prompt_range = [round(WORKLOAD["input_len"] * (1 - ratio)), round(WORKLOAD["input_len"] * (1 + ratio)) + 1]
    output_range = [round(WORKLOAD["output_len"] * (1 - ratio)), round(WORKLOAD["output_len"] * (1 + ratio)) + 1]
    runs = []
    for num_decodes in STEP_PROBES:
        specs = [RequestSpec(tuple(rng.integers(100, 40000, size=32).tolist()), None, 150, 0.0)
                 for _ in range(num_decodes)]
        # requests come and go meanwhile, as in any served load: their HTTP work shares the cores too
        arrivals_s = np.cumsum(rng.exponential(1 / PROBE_ARRIVAL_QPS, size=PROBE_ARRIVALS))
        for arrival_s in arrivals_s:
            size = int(rng.integers(*prompt_range))
            specs.append(RequestSpec(tuple(rng.integers(100, 40000, size=size).tolist()), None,
                                     int(rng.integers(*output_range)), float(arrival_s)))
        runs.append(specs)
    decode_steps, prompt_steps = [], []
    for specs in runs:
        decodes, prompts = probe_steps(base_url, clock, specs)
        decode_steps += decodes
        prompt_steps += prompts
    return fit_step_costs(decode_steps, prompt_steps)


def level_probe(rate_qps: float, level_index: int, after: bool):
    """A sample of LEVEL_PROBE_REQUESTS requests of the workload at a level's rate, sent right
    before the level and again right after it (so at its batch sizes, prompt lengths and arrival
    rate: fitted on 4-24 streams alone, the step time missed the levels' small batches by up to
    30%; and the two together span the host's drift over the level, 10-20% within a minute on
    this shared host). Its own seed and prompt salt: none of these requests is in the trace."""
    from shardserve.sim.workload import WorkloadConfig, build_workload

    tag = 10 * level_index + int(after)
    return build_workload(WorkloadConfig(num_requests=LEVEL_PROBE_REQUESTS, request_rate_qps=rate_qps,
                                         prompt_salt=20 + tag, seed=100 + tag, **WORKLOAD))


def probe_steps(base_url: str, clock, specs) -> tuple[list, list]:
    """Send the requests (arrival times as given) and read every step off their chunk times:
    (decode-only steps, steps with a prompt), each (sequences in the step, measured s, model s),
    the prompt steps with their decodes too, as fit_step_costs takes them."""
    from shardserve.bench.client import run_benchmark
    from shardserve.bench.stats import LoadLevel

    result = asyncio.run(run_benchmark(base_url, specs, None, level=LoadLevel(None, None), show_progress=False))
    prompt_lens = {i: spec.prompt_len for i, spec in enumerate(specs)}
    decode_steps, prompt_steps = [], []
    for duration_s, decodes, context_sum, prompts in server_steps(result.records, prompt_lens):
        row = (decodes + len(prompts), duration_s, clock.step_s(decodes, context_sum, prompts))
        if prompts:
            prompt_steps.append((*row, decodes))
        else:
            decode_steps.append(row)
    return decode_steps, prompt_steps


def model_clock(calibration: Calibrated, costs: tuple[float, float, float] = (1.0, 1.0, 0.0)):
    """The calibrated cost model's step clock, with serving's step costs (none by default)."""
    from shardserve.sim.step_clock import StepClock

    config = sim_config(calibration, 0.0, 0.0)
    return StepClock(config.deployment, config.setup.max_model_len, *costs)


def trace_step_ratios(result, specs, calibration: Calibrated, costs: tuple[float, float, float]) -> dict[str, float]:
    """Diagnosis only (nothing is fitted to it): measured / predicted step time over the trace's own
    steps, as read off its chunk times, as the fit takes them: the total time of decode-only steps
    and of prompt steps that carried decodes (the server was busy); the predictions are the step
    clock the simulator runs on."""
    clock = model_clock(calibration, costs)
    prompt_lens = {i: spec.prompt_len for i, spec in enumerate(specs)}
    decode, prompt = np.zeros(2), np.zeros(2)
    for duration_s, decodes, context_sum, prompts in server_steps(result.records, prompt_lens):
        predicted_s = clock.step_s(decodes, context_sum, prompts)
        if prompts and decodes:
            prompt += (duration_s, predicted_s)
        elif not prompts:
            decode += (duration_s, predicted_s)
    return {"decode": float(decode[0] / decode[1]), "prompt": float(prompt[0] / max(prompt[1], 1e-12))}


def metrics_of(result) -> dict[str, float]:
    return {"output_tok_s": result.output_throughput_tok_s, "ttft_p50": result.ttft.p50_ms,
            "ttft_p90": result.ttft.p90_ms, "tpot_p50": result.tpot.p50_ms, "tpot_p90": result.tpot.p90_ms}


def measure(calibration: Calibrated, rates: list[float] | None, num_requests: int):
    """Probe the server's HTTP path, then per level its step times right before and right after
    the level runs (a shared host's speed drifts within a minute), and the level itself:
    (results, rates, HTTP delay, step costs per level, capacities, trace step ratios per level).
    Without `rates`, 0.35 and 0.7 of the server's measured capacity (so that "high" is the same
    real load from run to run; the simulated capacity is reported next to it as one more error)."""
    from shardserve.bench.client import run_benchmark
    from shardserve.bench.stats import LoadLevel
    from shardserve.ports import free_port
    from shardserve.server.process import server_process

    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", calibration.dtype, "--quantization", "none",
           "--port", str(port),
           "--kv-cache-memory", str(KV_CACHE_BYTES), "--log-level", "warning"]
    with server_process(cmd, port) as (base_url, _):
        http_delay_s = probe_http_delay_s(base_url)
        print(f"HTTP path outside the engine: {http_delay_s * 1e3:.2f} ms per request (client TTFT - server TTFT)",
              flush=True)
        clock = model_clock(calibration)
        costs = probe_step_costs(base_url, clock)
        print_costs("capacity", costs)
        # capacity: the rate a burst of CAPACITY_REQUESTS is served at, measured and simulated
        capacity = {"measured": measured_capacity_qps(base_url, CAPACITY_REQUESTS),
                    "simulated": predicted_capacity_qps(sim_config(calibration, 0.0, 0.0, costs), CAPACITY_REQUESTS)}
        print(f"capacity: measured {capacity['measured']:.2f} req/s, simulated {capacity['simulated']:.2f} req/s",
              flush=True)
        if rates is None:
            rates = [round(0.35 * capacity["measured"], 2), round(0.7 * capacity["measured"], 2)]
            print(f"levels {rates[0]} and {rates[1]} req/s", flush=True)
        results, level_costs, step_ratios = [], [], []
        for i, rate in enumerate(rates):
            before = probe_steps(base_url, clock, level_probe(rate, i, after=False))
            specs = workload(rate, i, num_requests)
            results.append(asyncio.run(run_benchmark(base_url, specs, None, level=LoadLevel(None, rate),
                                                     show_progress=False)))
            after = probe_steps(base_url, clock, level_probe(rate, i, after=True))
            for label, (decodes, prompts) in (("before", before), ("after", after)):
                print_costs(f"{LEVEL_NAMES[i]}, probed {label}", fit_step_costs(decodes, prompts, costs[2]))
            # the per-sequence cost is the wide capacity probe's: over one level's few batch sizes
            # it cannot be told from the scale
            level_costs.append(fit_step_costs(before[0] + after[0], before[1] + after[1], costs[2]))
            print_costs(LEVEL_NAMES[i], level_costs[-1])
            step_ratios.append(trace_step_ratios(results[-1], specs, calibration, level_costs[-1]))
    return results, rates, http_delay_s, level_costs, capacity, step_ratios


def print_costs(label: str, costs: tuple[float, float, float]) -> None:
    print(f"{label}: serving steps vs calibrated cost model: decode-only steps x{costs[0]:.3f}, "
          f"steps with a prompt x{costs[1]:.3f}, plus {costs[2] * 1e3:.3f} ms per sequence", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=None, help="skip profiling: use this calibration.json")
    parser.add_argument("--num-requests", type=int, default=120, help="per load level")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="what the server runs and the profile calibrates (float32 on a CPU without AVX512-BF16)")
    parser.add_argument("--rates", default=None, help="the two levels in req/s (default: 0.35 and 0.7 of the "
                                                      "server's measured capacity)")
    args = parser.parse_args()

    from shardserve.bench.cli_args import format_result

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        calibration = Path(args.calibration) if args.calibration else calibrate(Path(tmp) / "profile", args.dtype)
        saved = RESULTS / "sim_accuracy_calibration.json"
        RESULTS.mkdir(exist_ok=True)
        saved.write_text(calibration.read_text())
    rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    calibrated = Calibrated(saved, args.dtype)
    measured, rates, http_delay_s, level_costs, capacity, step_ratios = measure(calibrated, rates, args.num_requests)
    # each level on its own simulated server, with the step costs probed around it
    simulated = [simulate_level(calibrated, i, rate, http_delay_s, costs, args.num_requests)
                 for i, (rate, costs) in enumerate(zip(rates, level_costs))]

    print("\n--- measured (shardserve serve + bench client) ---")
    print("\n".join(format_result(r) for r in measured))
    print("\n--- simulated (shardserve simulate) ---")
    print("\n".join(format_result(r) for r in simulated))
    errors: dict[str, float] = {}
    print(f"\n{'level':<6}{'metric':<14}{'measured':>12}{'simulated':>12}{'rel. error':>12}")
    for name, real, sim in zip(LEVEL_NAMES, measured, simulated):
        real_m, sim_m = metrics_of(real), metrics_of(sim)
        for metric, error in level_errors(real, sim).items():
            errors[f"{name}_{metric}_error"] = round(error, 4)
            print(f"{name:<6}{metric:<14}{real_m[metric]:>12.2f}{sim_m[metric]:>12.2f}{error:>12.1%}")
    for name, ratios in zip(LEVEL_NAMES, step_ratios):
        print(f"{name}: the trace's own steps, measured / step clock: decode-only x{ratios['decode']:.3f} (total "
              f"time), with a prompt and decodes x{ratios['prompt']:.3f} (total time)")
    at_trace_speed = trace_speed_errors(calibrated, rates, http_delay_s, level_costs, step_ratios, measured,
                                        args.num_requests)
    print(f"diagnosis (fitted to the trace, not the target): each level simulated at its own steps' speed "
          f"(the scales times the ratios above): median error {np.median(at_trace_speed):.1%}, "
          f"max {max(at_trace_speed):.1%}")
    values = list(errors.values())
    summary = {"median_error": round(float(np.median(values)), 4), "max_error": round(max(values), 4), **errors,
               "rates_qps": rates, "num_requests_per_level": args.num_requests,
               "http_delay_ms": round(http_delay_s * 1e3, 3),
               "step_costs": {name: {"decode_step_scale": round(c[0], 4), "prompt_step_scale": round(c[1], 4),
                                     "step_seq_ms": round(c[2] * 1e3, 4)} for name, c in zip(LEVEL_NAMES, level_costs)},
               "trace_step_ratios": {name: {k: round(v, 4) for k, v in r.items()}
                                     for name, r in zip(LEVEL_NAMES, step_ratios)},
               "trace_speed_errors": {"median": round(float(np.median(at_trace_speed)), 4),
                                      "max": round(max(at_trace_speed), 4)},
               "capacity_qps": {k: round(v, 3) for k, v in capacity.items()},
               "capacity_error": round(abs(capacity["simulated"] - capacity["measured"]) / capacity["measured"], 4),
               "calibration_mape": _calibration_mape(saved),
               "target": {"max_error": 0.15, "median_error": 0.10}, "wall_s": round(time.perf_counter() - start, 1)}
    (RESULTS / "sim_accuracy.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


def trace_speed_errors(calibrated: Calibrated, rates, http_delay_s: float, level_costs, step_ratios, measured,
                       num_requests: int) -> list[float]:
    """Diagnosis only: the errors of each level simulated with its step scales times the trace's
    own measured / step-clock ratios, i.e. at the speed the server actually ran the level (the
    per-sequence cost as probed). What is left is the simulated schedule's error; the difference
    from the real errors is what the host's drift between the probes and the level costs."""
    errors = []
    for i, (rate, costs, ratios, real) in enumerate(zip(rates, level_costs, step_ratios, measured)):
        costs = (costs[0] * ratios["decode"], costs[1] * ratios["prompt"], costs[2])
        errors += level_errors(real, simulate_level(calibrated, i, rate, http_delay_s, costs, num_requests)).values()
    return errors


def simulate_level(calibrated: Calibrated, level_index: int, rate: float, http_delay_s: float,
                   costs: tuple[float, float, float], num_requests: int):
    """One level's trace on its own simulated server, with these step costs."""
    from shardserve.bench.stats import LoadLevel
    from shardserve.sim.simulation import simulate

    sim, = simulate(sim_config(calibrated, http_delay_s / 2, http_delay_s / 2, costs),
                    [(LoadLevel(None, rate), workload(rate, level_index, num_requests))])
    return sim


def level_errors(real, sim) -> dict[str, float]:
    """|simulated - measured| / measured of each metric."""
    real_m, sim_m = metrics_of(real), metrics_of(sim)
    return {m: abs(sim_m[m] - real_m[m]) / real_m[m] for m in METRICS}


def _calibration_mape(path: Path) -> float | None:
    devices = json.loads(path.read_text()).get("devices", {})
    return next((d.get("step_time_mape") for d in devices.values()), None)


if __name__ == "__main__":
    main()
