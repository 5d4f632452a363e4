"""Quantized serving: shardserve with `--quantization gguf` against llama.cpp's `llama-server` on the
same Q4_0, Q4_1 and Q8_0 GGUF files of SmolLM2-135M-Instruct.

Both keep the file's blocks (ours: layers/block_quant.py). The workload is serve_vs_llamacpp's:
128-token prompts of random ids, 128 output tokens with `ignore_eos`, temperature 0, closed loop at
concurrency 1 and 32; both get the same KV budget (32 x 512 tokens) in a 16-bit KV cache (ours
runs with `--dtype bfloat16`, llama-server keeps its default f16 cache). Q4_1 is the embedded file;
Q4_0 and Q8_0 are made from its exact F32 dequantization with `llama-quantize` (cached), so the
three files hold the same model.

Also printed, from the same run: the memory bandwidth this host gives torch (a 256 MiB read; for
mbu_b1 the mean of reads right before and right after our Q4_1 server runs, as the host's speed
moves within minutes), the bytes a batch-1 decode step reads (every linear weight and the LM
head, in their blocks), mbu_b1 = those bytes / bandwidth / our TPOT p50 at concurrency 1 (Q4_1),
and each server's peak RSS (VmHWM) against the file plus the KV budget. Our process also holds Python, torch and the HTTP
stack (`runtime_rss_mib`: the peak RSS of a process that imports the server's modules and loads
nothing); the bound is checked on what the server holds above that.

llama-server is built as serve_vs_llamacpp.py's docstring says (add `llama-quantize`).
Run: .venv/bin/python benchmarks/quantized_decode.py [--llama-bin-dir DIR] [--quick] [--formats Q4_1]
Last line: RESULT {"q4_0_ratio_c1", "q4_0_ratio_c32", "q4_1_ratio_c1", "q4_1_ratio_c32", "q8_0_ratio_c1",
"q8_0_ratio_c32", "mbu_b1", ...} (ratios: shardserve / llama-server output tok/s).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from serve_vs_llamacpp import run_levels
from serving_levels import log, smollm2_gguf
from shardserve.ports import free_port
from shardserve.server.process import server_process

RESULTS = Path(__file__).parent / "results"
TAG = "quantized_decode"
FORMATS = ("Q4_0", "Q4_1", "Q8_0")
KV_TOKENS = 32 * 512
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2: layers x (K, V) x KV heads x head dim x 2 bytes (bf16 / f16)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def read_bandwidth_gb_s() -> float:
    """Bytes per second torch reads from memory on this host (a 256 MiB sum, best of 5)."""
    data = torch.ones(32 << 20, dtype=torch.int64)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 8 / best / 1e9


def runtime_rss_mib() -> float:
    """The RSS of a process that imported what our server imports and loaded no model."""
    # VmHWM, not ru_maxrss: that one carries the parent's peak across fork and exec
    code = ("import shardserve.server.serve, shardserve.server.api, shardserve.engine.launcher, torch, pathlib; "
            "print(next(l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out.split()[1]) / 1024


def step_bytes(gguf: Path) -> int:
    """What a batch-1 decode step reads of the file: every 2-D weight but the embedding, whose
    rows are looked up (SmolLM2 ties it to the LM head, which reads it whole)."""
    from shardserve.models.gguf_file import GGUFFile

    tensors = GGUFFile.open(gguf).tensors
    layers = sum(t.num_bytes for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return layers + head.num_bytes


def serve(name: str, cmd: list[str], port: int, levels, args, salt: int, extra_body: dict) -> tuple[dict, float]:
    log(TAG, f"[{name}] starting: {' '.join(cmd)}")
    with server_process(cmd, port, startup_timeout_s=300) as (url, proc):
        log(TAG, f"[{name}] ready")
        results = run_levels(name, url, levels, args, salt=salt, extra_body=extra_body)
        return results, peak_rss_mib(proc.pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin-dir", type=Path, default=Path(os.environ.get("LLAMA_BIN_DIR", "../llamacpp/build/bin")))
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "shardserve-bench")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", default="16,64", help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4/16 requests, 32 output tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.output_len = "4,16", 32
    levels = list(zip(map(int, args.concurrency.split(",")), map(int, args.requests.split(","))))
    if not (args.llama_bin_dir / "llama-server").exists():
        sys.exit(f"llama-server not found in {args.llama_bin_dir} (see serve_vs_llamacpp.py's docstring to build it)")
    max_par = max(c for c, _ in levels)
    kv_bytes = KV_TOKENS * KV_BYTES_PER_TOKEN
    bandwidth = read_bandwidth_gb_s()
    runtime = runtime_rss_mib()
    log(TAG, f"read bandwidth {bandwidth:.1f} GB/s; our runtime alone {runtime:.0f} MiB RSS")
    result: dict = {"read_bandwidth_gb_s": bandwidth, "runtime_rss_mib": runtime, "kv_budget_mib": kv_bytes / 2**20}
    for fmt in args.formats.split(","):
        gguf = smollm2_gguf(fmt, args.llama_bin_dir, args.cache_dir)
        port = free_port()
        ours_cmd = [sys.executable, "-m", "shardserve.cli", "serve", str(gguf), "--quantization", "gguf",
                    "--dtype", "bfloat16", "--port", str(port), "--kv-cache-memory", str(kv_bytes), "--max-model-len", "2048",
                    "--log-level", "warning"]
        around = [read_bandwidth_gb_s()]
        ours, ours_rss = serve(f"shardserve {fmt}", ours_cmd, port, levels, args, 1, {})
        around.append(read_bandwidth_gb_s())
        port = free_port()
        llama_cmd = [str(args.llama_bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                     str(port), "-t", "2", "-np", str(max_par), "-c", str(KV_TOKENS), "--cont-batching"]
        theirs, theirs_rss = serve(f"llama-server {fmt}", llama_cmd, port, levels, args, 2, {"cache_prompt": False})
        key = fmt.lower()
        file_mib = gguf.stat().st_size / 2**20
        for c, _ in levels:
            result[f"{key}_ratio_c{c}"] = ours[c]["output_tok_s"] / theirs[c]["output_tok_s"]
            print(f"{fmt} c={c:<3} shardserve {ours[c]['output_tok_s']:7.1f} tok/s (TPOT p50 {ours[c]['tpot_p50_ms']:.2f} ms)"
                  f"  llama-server {theirs[c]['output_tok_s']:7.1f} tok/s (TPOT p50 {theirs[c]['tpot_p50_ms']:.2f} ms)"
                  f"  ratio {result[f'{key}_ratio_c{c}']:.3f}", flush=True)
        bound = 1.2 * (file_mib + kv_bytes / 2**20)
        print(f"{fmt} peak RSS: shardserve {ours_rss:.0f} MiB ({ours_rss - runtime:.0f} over the runtime), "
              f"llama-server {theirs_rss:.0f} MiB; 1.2 x (file {file_mib:.0f} + KV {kv_bytes / 2**20:.0f}) = {bound:.0f} MiB",
              flush=True)
        result[f"{key}_rss_ratio"] = (ours_rss - runtime) / (file_mib + kv_bytes / 2**20)
        result[f"{key}_peak_rss_mib"] = {"shardserve": ours_rss, "llama_server": theirs_rss}
        result[f"{key}_runs"] = {"shardserve": ours, "llama_server": theirs}
        if fmt == "Q4_1" and 1 in dict(levels):
            moved = step_bytes(gguf)
            result["step_bytes_mb"] = moved / 1e6
            near = sum(around) / 2
            result["mbu_b1_bandwidth_gb_s"] = near
            result["mbu_b1"] = moved / (near * 1e9) / (ours[1]["tpot_p50_ms"] / 1e3)
            print(f"Q4_1 batch 1: {moved / 1e6:.1f} MB a step, bound {moved / near / 1e6:.2f} ms at {near:.1f} GB/s "
                  f"(read {around[0]:.1f} before our server, {around[1]:.1f} after), TPOT p50 "
                  f"{ours[1]['tpot_p50_ms']:.2f} ms: MBU {result['mbu_b1']:.2f}", flush=True)
    result["quick"] = args.quick
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"quantized_decode{'_quick' if args.quick else ''}.json").write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps({k: round(v, 3) for k, v in result.items() if isinstance(v, float)}))


if __name__ == "__main__":
    main()
