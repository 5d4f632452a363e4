"""Draft-model speculation where no smaller model is at hand: SmolLM2 in bfloat16 drafted by its
own GGUF kept in Q4_1 blocks (`--speculative-config '{"model": "smollm2", "quantization": "gguf"}'`),
against the same server without speculation.

The quantized copy decodes a batch-1 step 2-3x faster than the bf16 target and agrees with it on
most greedy tokens, so verifying its guesses pays at low load; the policy (engine/
speculation_policy.py, left on "auto") has to find that out, and stop at high load. Two `shardserve
serve` side by side, alternating rounds (order reversed every other round):
    c1   16 requests of the plain random workload (128-token prompts, 128 output tokens, ignore_eos,
         greedy) at concurrency 1
    c32  64 requests of the same at concurrency 32
Greedy outputs must be the same with and without the draft (the c=1 answers are compared).

Run: .venv/bin/python benchmarks/draft_speculation.py [--rounds 2] [--num-speculative-tokens 3]
         [--disable-by-batch-size N]
Last line: RESULT {"draft_speedup_c1", "draft_ratio_c32", "acceptance_rate_c1", "acceptance_rate_c32", ...}
"""
from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from pathlib import Path

from serving_levels import log, run_level
from shardserve.sim.workload import WorkloadConfig, build_workload
from speculative import answers, delta, spec_counters, start_servers

RESULTS = Path(__file__).parent / "results"
TAG = "draft_speculation"
LEVELS = {"c1": (1, 16), "c32": (32, 64)}  # concurrency, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    args = parser.parse_args()
    draft = {"model": "smollm2", "quantization": "gguf", "num_speculative_tokens": args.num_speculative_tokens,
             "disable_by_batch_size": args.disable_by_batch_size}
    configs = {"off": None, "draft": draft}
    runs: dict[str, dict[str, list[dict]]] = {level: {name: [] for name in configs} for level in LEVELS}
    counters: dict[str, dict] = {}
    with ExitStack() as stack:
        servers = start_servers(stack, configs, TAG)
        for level, (concurrency, num_requests) in LEVELS.items():
            before = spec_counters(servers["draft"])
            for round_ in range(args.rounds):
                order = list(servers.items())
                for name, url in (order if round_ % 2 == 0 else order[::-1]):
                    log(TAG, f"[{name}] {level}, round {round_ + 1}")
                    config = WorkloadConfig(num_requests=num_requests, input_len=128, output_len=128, seed=round_,
                                            prompt_salt=concurrency)
                    runs[level][name].append(run_level(url, config, concurrency))
            counters[level] = delta(spec_counters(servers["draft"]), before)
        check = [list(spec.prompt_token_ids) for spec in build_workload(WorkloadConfig(num_requests=6, input_len=64, output_len=64,
                                                                               seed=99, prompt_salt=3))]
        same = [a == b for a, b in zip(answers(servers["off"], check, 96), answers(servers["draft"], check, 96))]

    def tok_s(level: str, name: str) -> float:
        return statistics.fmean(r["output_tok_s"] for r in runs[level][name])

    def acceptance(level: str) -> float:
        return counters[level]["num_accepted_tokens"] / max(counters[level]["num_draft_tokens"], 1)

    for level in LEVELS:
        print(f"{level}: off {tok_s(level, 'off'):.1f} tok/s, draft {tok_s(level, 'draft'):.1f} tok/s "
              f"({tok_s(level, 'draft') / tok_s(level, 'off'):.3f}); verifications {counters[level]['num_drafts']:.0f}, "
              f"acceptance {acceptance(level):.3f}", flush=True)
    print(f"greedy answers identical with and without the draft: {sum(same)}/{len(same)}")
    summary = {"draft_speedup_c1": tok_s("c1", "draft") / tok_s("c1", "off"),
               "draft_ratio_c32": tok_s("c32", "draft") / tok_s("c32", "off"),
               "acceptance_rate_c1": acceptance("c1"), "acceptance_rate_c32": acceptance("c32"),
               "identical_answers": f"{sum(same)}/{len(same)}"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "draft_speculation.json").write_text(json.dumps({**summary, "runs": runs, "counters": counters,
                                                                "draft": draft, "rounds": args.rounds}, indent=1))
    print("RESULT " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
