"""What the serving benchmarks (serve_vs_vllm.py, serve_vs_llamacpp.py) share: a server kept up
for the length of a block, and one closed-loop level driven by `shardserve bench`'s client."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from shardserve.bench.client import run_benchmark_sync
from shardserve.models.checkpoint import resolve_model_path
from shardserve.server.process import server_process
from shardserve.sim.workload import WorkloadConfig, build_workload


def log(tag: str, message: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextmanager
def started(tag: str, name: str, cmd: list[str], port: int, env: dict | None = None, startup_timeout_s: float = 600):
    """The server `cmd` listening on `port`, its base URL yielded; stopped on leaving."""
    log(tag, f"[{name}] starting: {' '.join(cmd)}")
    with server_process(cmd, port, startup_timeout_s=startup_timeout_s, env=env) as (url, _):
        log(tag, f"[{name}] ready")
        yield url


def warm_up(url: str, salt: int, input_len: int = 64, extra_body: dict | None = None) -> None:
    """Four short requests, so that no measured level pays a first request's costs."""
    warm = build_workload(WorkloadConfig(num_requests=4, input_len=input_len, output_len=8, seed=999, prompt_salt=salt))
    run_benchmark_sync(url, warm, concurrency=4, show_progress=False, extra_body=extra_body)


def run_level(url: str, config: WorkloadConfig, concurrency: int, extra_body: dict | None = None) -> dict:
    """One closed-loop level: its throughput and latency percentiles; a failed request is an error."""
    result = run_benchmark_sync(url, build_workload(config), concurrency=concurrency, extra_body=extra_body,
                                show_progress=False)
    if result.num_failed:
        raise RuntimeError(f"{result.num_failed} requests failed at {url}: {result.error_samples}")
    return {
        "output_tok_s": result.output_throughput_tok_s, "ttft_p50_ms": result.ttft.p50_ms,
        "ttft_p99_ms": result.ttft.p99_ms, "tpot_p50_ms": result.tpot.p50_ms, "e2e_p50_ms": result.e2e.p50_ms,
        "num_requests": config.num_requests, "output_tokens": result.total_output_tokens,
    }


def smollm2_gguf(fmt: str, bin_dir: Path, cache_dir: Path) -> Path:
    """The embedded SmolLM2 GGUF (Q4_1) in llama.cpp type `fmt`: the file itself, its exact
    dequantization (F32, BF16), or another type made from the F32 with `llama-quantize` (cached)."""
    src = resolve_model_path("smollm2")
    if fmt == "Q4_1":
        return src
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"SmolLM2-135M-Instruct.{fmt}.gguf"
    if not out.exists():
        dequantized = fmt in ("F32", "BF16")
        source = src if dequantized else smollm2_gguf("F32", bin_dir, cache_dir)
        flags = ["--allow-requantize"] if dequantized else []
        subprocess.run([str(bin_dir / "llama-quantize"), *flags, str(source), str(out), fmt, "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out
