"""What exact resume costs: serving throughput at 32 concurrent streams with `--deterministic`
(the default: the attention kernels whose result for a token does not depend on the path that
computed it) against `--no-deterministic` (the fastest kernels whatever their rounding: the AMX
tiles for prefill attention on CPUs that have AMX). Where the CPU has no AMX the two run the same
kernels and the ratio is 1 by construction; the cost against the kernels before exactness was
measured in the commit that made them (an A/B of builds, not something one checkout can run).

Both servers (embedded model, bfloat16, as `make serve`) are up together; each level runs on one
then the other, the order alternating, twice; each side's best run counts.

Run
    .venv/bin/python benchmarks/deterministic_ratio.py
    The last line is `RESULT {"deterministic_ratio_c32", "deterministic_ratio_c32_mixed", "amx", ...}`,
    also saved as benchmarks/results/deterministic_ratio.json. Target: >= 0.9. Run it alone.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from serving_levels import log, run_level, started, warm_up
from shardserve.ports import free_port
from shardserve.sim.workload import WorkloadConfig

RESULTS = Path(__file__).parent / "results"
TAG = "deterministic_ratio"
WORKLOADS = {"uniform": dict(input_len=128, output_len=128, range_ratio=0.0),
             "mixed": dict(input_len=264, output_len=136, range_ratio=0.94)}
CONCURRENCY, NUM_REQUESTS, ROUNDS, SETTLE_S = 32, 64, 2, 2.0


def main() -> None:
    servers: dict[str, tuple[str, int]] = {}
    with ExitStack() as stack:
        for salt, flag in enumerate(("--deterministic", "--no-deterministic"), start=1):
            port = free_port()
            cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", "bfloat16", "--quantization", "none", "--port",
                   str(port), "--kv-cache-memory", str(1 << 30), "--max-model-len", "2048", "--log-level", "warning",
                   flag]
            url = stack.enter_context(started(TAG, flag, cmd, port))
            warm_up(url, salt)
            servers[flag] = (url, salt)
        best: dict = {flag: {} for flag in servers}
        index = 0
        for round_ in range(ROUNDS):
            for workload, shape in WORKLOADS.items():
                order = list(servers) if index % 2 == 0 else list(servers)[::-1]
                index += 1
                for flag in order:
                    url, salt = servers[flag]
                    config = WorkloadConfig(num_requests=NUM_REQUESTS, seed=round_, prompt_salt=salt * 10 + round_,
                                            **shape)
                    time.sleep(SETTLE_S)
                    result = run_level(url, config, CONCURRENCY)
                    log(TAG, f"[{flag}] {workload} c={CONCURRENCY} round {round_}: {result['output_tok_s']:.1f} tok/s")
                    if result["output_tok_s"] > best[flag].get(workload, {}).get("output_tok_s", 0):
                        best[flag][workload] = result
    det, fast = best["--deterministic"], best["--no-deterministic"]
    summary = {"deterministic_ratio_c32": det["uniform"]["output_tok_s"] / fast["uniform"]["output_tok_s"],
               "deterministic_ratio_c32_mixed": det["mixed"]["output_tok_s"] / fast["mixed"]["output_tok_s"],
               "amx": "amx_bf16" in Path("/proc/cpuinfo").read_text(), "deterministic": det, "fastest": fast}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "deterministic_ratio.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
