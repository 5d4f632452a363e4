"""Parallel scaling: one small model under tp in {1, 2} x pp in {1, 2}, with each rank's step
time split into compute, communication and pipeline waiting.

Model
    A Llama-shaped model with random weights, generated locally once (transformers, cached in
    ~/.cache/shardserve-bench/): hidden 512, 8 layers, 8 heads, 4 KV heads, MLP 1536, vocab
    32000, ~60M parameters. (SmolLM2's 9 heads do not split over tp=2.) `--model` takes any
    other checkpoint.

What it measures
    For every layout, the same fixed workload (16 requests, 64-token random prompts, 32 greedy
    output tokens each, EOS ignored) through `LLMEngine` with that layout; the ranks are real
    processes joined by gloo on this host. Reported per layout:
      tok_s          output tokens / wall time of the stepping loop
      speedup        tok_s / tok_s of tp=1, pp=1 (the baseline, run first, same script)
      per rank       mean step ms, split into compute (its layers and head, collectives
                     excluded), comm (inside tp all-reduce / all-gather) and wait (blocked on
                     the other pipeline stages or the step's sampled tokens)
      bubble         for pp > 1: mean over ranks of wait / step time, next to the ideal
                     (pp - 1) / (m + pp - 1) for m micro-batches per step
    Step statistics come from the engine itself (`LLMEngine.step_stats`), measured on each rank
    with perf_counter around its forward passes and collectives.

Caveat
    This host has 2 cores, so 4 ranks share 2 cores (one thread each) and tp/pp cannot speed
    anything up here: the figures show where the time goes, not the scaling a machine with a
    core (or GPU) per rank would get.

Run
    .venv/bin/python benchmarks/parallel_scaling.py [--model PATH] [--num-requests 16]
    Each layout runs in a child process (a fresh process group); progress goes to stderr, the
    table to stdout, a plot to benchmarks/results/parallel_scaling.png, and the last line is
    `RESULT {json}` (also saved as benchmarks/results/parallel_scaling.json). About 2 minutes.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


SYNTHETIC = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def synthetic_model() -> str:
    """Write (once) the random Llama described in the module docstring; return its folder."""
    folder = Path.home() / ".cache" / "shardserve-bench" / "llama-60m-random"
    if not (folder / "model.safetensors").exists():
        import torch
        import transformers

        sys.path.insert(0, str(Path(__file__).parents[1]))
        from tests.conftest import write_tokenizer

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(bos_token_id=0, eos_token_id=1, **SYNTHETIC))
        model.save_pretrained(folder)
        write_tokenizer(folder)
    return str(folder)


def run_layout(args: argparse.Namespace) -> dict:
    """In the child: run the workload under one layout, return its figures."""
    from shardserve.config import CacheConfig, EngineConfig, ParallelConfig
    from shardserve.engine.launcher import build_engine
    from shardserve.request import SamplingParams

    config = EngineConfig(model=args.model, dtype=args.dtype, show_progress=False, max_model_len=1024,
                          cache=CacheConfig(kv_cache_memory_bytes=256 << 20),
                          parallel=ParallelConfig(tp_size=args.tp, pp_size=args.pp))
    engine = build_engine(config)
    try:
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        vocab = engine.model_config.vocab_size

        def run(num: int, tag: str) -> tuple[int, float, int]:
            for i in range(num):
                engine.add_request(f"{tag}{i}", [rng.randrange(100, vocab) for _ in range(args.prompt_len)], params)
            tokens, steps, start = 0, 0, time.perf_counter()
            while engine.has_unfinished_requests():
                tokens += sum(len(out.new_token_ids) for out in engine.step())
                steps += 1
            return tokens, time.perf_counter() - start, steps

        run(2, "warm")
        engine.step_stats(reset=True)
        tokens, wall_s, num_steps = run(args.num_requests, "r")
        ranks = [dict(rank=s.rank, step_ms=1e3 * s.step_s / s.num_steps, compute_ms=1e3 * s.compute_s / s.num_steps,
                      comm_ms=1e3 * s.comm_s / s.num_steps, wait_ms=1e3 * s.wait_s / s.num_steps,
                      bubble=s.bubble_fraction) for s in engine.step_stats()]
        if not ranks:  # a single process: the whole step is compute
            step_ms = 1e3 * wall_s / num_steps
            ranks = [dict(rank=0, step_ms=step_ms, compute_ms=step_ms, comm_ms=0.0, wait_ms=0.0, bubble=0.0)]
    finally:
        engine.shutdown()
    m = args.pp  # micro-batches per step default to pp
    return dict(tp=args.tp, pp=args.pp, tok_s=tokens / wall_s, num_steps=num_steps, ranks=ranks,
                bubble=sum(r["bubble"] for r in ranks) / len(ranks) if args.pp > 1 else 0.0,
                ideal_bubble=(args.pp - 1) / (m + args.pp - 1))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, compute, comm, wait = [], [], [], []
    for res in results:
        for r in res["ranks"]:
            labels.append(f"tp{res['tp']} pp{res['pp']}\nrank {r['rank']}")
            compute.append(r["compute_ms"])
            comm.append(r["comm_ms"])
            wait.append(r["wait_ms"])
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    x = range(len(labels))
    ax.bar(x, compute, label="compute")
    ax.bar(x, comm, bottom=compute, label="communication")
    ax.bar(x, wait, bottom=[a + b for a, b in zip(compute, comm)], label="pipeline wait")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title("Where each rank's step time goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the synthetic 60M Llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--pp", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp is not None:
        print(json.dumps(run_layout(args)))
        return
    args.model = args.model or synthetic_model()
    results = []
    for tp, pp in LAYOUTS:
        print(f"[parallel_scaling] tp={tp} pp={pp} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype, "--num-requests",
               str(args.num_requests), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--tp", str(tp), "--pp", str(pp)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            sys.exit(f"layout tp={tp} pp={pp} failed:\n{proc.stderr[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = results[0]["tok_s"]
    print(f"{'layout':<10}{'tok/s':>8}{'speedup':>9}  per rank: step = compute + comm + wait (ms)   bubble (ideal)")
    for res in results:
        res["speedup"] = res["tok_s"] / base
        per_rank = "  ".join(f"r{r['rank']}: {r['step_ms']:.1f}={r['compute_ms']:.1f}+{r['comm_ms']:.1f}+{r['wait_ms']:.1f}"
                             for r in res["ranks"])
        bubble = f"   {res['bubble']:.2f} ({res['ideal_bubble']:.2f})" if res["pp"] > 1 else ""
        print(f"tp{res['tp']} pp{res['pp']:<5}{res['tok_s']:>8.1f}{res['speedup']:>9.2f}  {per_rank}{bubble}")
    RESULTS.mkdir(exist_ok=True)
    plot(results, RESULTS / "parallel_scaling.png")
    summary = {f"tp{r['tp']}_pp{r['pp']}": {"tok_s": round(r["tok_s"], 1), "speedup": round(r["speedup"], 3),
                                            "bubble": round(r["bubble"], 3), "ideal_bubble": round(r["ideal_bubble"], 3),
                                            "ranks": [{k: round(v, 2) if isinstance(v, float) else v for k, v in rank.items()}
                                                      for rank in r["ranks"]]} for r in results}
    (RESULTS / "parallel_scaling.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
