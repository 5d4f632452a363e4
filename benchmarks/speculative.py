"""Speculative decoding with n-gram proposals: serving throughput with `--speculative-config
'{"method": "ngram"}'` (the policy left to decide) against the same server without it, and
against one that speculates on every step it can (`"policy": "always"`).

Three `shardserve serve` of the embedded model in bfloat16, up side by side and loaded one at a
time, in alternating rounds (off, ngram, always, off, ...), so a drift of this shared host shows
in all three (the order reversed every other round):
    reuse         c=1   16 chat prompts whose answers copy their prompt (repeat, rewrite in the
                        past tense, fix spelling, rename a parameter, add type hints), greedy, up
                        to 256 tokens, ending at EOS as users' requests do
    busy          c=32  the plain random workload of the serving benchmarks (128-token random
                        prompts, 128 output tokens, ignore_eos, greedy), 96 requests
    busy_sampled  c=32  the same at temperature 1 (and the model's top_p 0.9), one seed for all
                        requests so that every server decodes the same tokens; few proposals hold
Throughput is output tokens over wall time (`shardserve bench`'s client). Greedy answers must be
the same with speculation on and off (every reuse answer is compared); acceptance comes from the
speculating servers' vllm:spec_decode_* counters, scraped around each block.

Run
    .venv/bin/python benchmarks/speculative.py [--rounds 2] [--quick]
    Last line: RESULT {"ngram_speedup_c1", "busy_ratio_c32", "acceptance_rate", ...}
    (ngram / off unless named "always_"; also benchmarks/results/speculative.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serving_levels import log, run_level, started, warm_up
from shardserve.bench.client import run_benchmark_sync
from shardserve.ports import free_port
from shardserve.sim.workload import RequestSpec, WorkloadConfig, build_workload

RESULTS = Path(__file__).parent / "results"
TAG = "speculative"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SERVERS = {"off": None, "ngram": SPEC, "always": {**SPEC, "policy": "always"}}
BLOCKS = {"reuse": (1, 0.0), "busy": (32, 0.0), "busy_sampled": (32, 1.0)}  # (concurrency, temperature)
SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five "
    "books at a time, and each loan lasts three weeks. Late returns cost ten cents per day.",
    "Our team meets every Monday to plan the week. We review open tickets, assign owners, and agree on "
    "priorities. On Friday we hold a short demo of what shipped.",
    "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, pour the water, and wait "
    "four minutes before serving.",
    "The train to the coast leaves from platform four at ten past eight. It stops at the old town, the river "
    "bridge and the harbour, and arrives at the beach station at half past nine.",
]
MISSPELT = [
    "The wether today is sunny and warm, with a light breze from the west. Tomorow we expect clouds and some "
    "rain in the afternon.",
    "Please remeber to bring your pasport and your ticket to the airport. The flight leaves at noon and "
    "boarding closes twenty minites before.",
]
CODE = [
    "def total(x):\n    s = 0\n    for i in x:\n        s = s + i\n    return s\n",
    "def largest(x):\n    best = x[0]\n    for i in x:\n        if i > best:\n            best = i\n    return best\n",
    "def count_words(x):\n    counts = {}\n    for word in x.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n",
]


def reuse_tasks() -> list[str]:
    tasks = []
    for text in PARAGRAPHS:
        tasks.append(f"Repeat the following text exactly, word for word:\n\n{text}")
        tasks.append(f"Rewrite the following text in the past tense:\n\n{text}")
    for text in MISSPELT:
        tasks.append(f"Correct the spelling mistakes in this text and write out the corrected text:\n\n{text}")
    for code in CODE:
        tasks.append(f"Rewrite this Python function, renaming the parameter x to items. Output only the code.\n\n{code}")
        tasks.append(f"Add type hints to this Python function. Output only the code.\n\n{code}")
    return tasks


def chat_prompt_ids(url: str, task: str) -> list[int]:
    body = {"messages": [{"role": "user", "content": task}], "add_generation_prompt": True}
    response = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["tokens"]


def answers(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    out = []
    for ids in prompts:
        body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        out.append(response.json()["choices"][0]["text"])
    return out


def reuse_level(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    specs = [RequestSpec(tuple(ids), None, max_tokens) for ids in prompts]
    result = run_benchmark_sync(url, specs, concurrency=1, ignore_eos=False, show_progress=False)
    if result.num_failed:
        raise RuntimeError(f"{result.num_failed} requests failed at {url}: {result.error_samples}")
    return {"output_tok_s": result.output_throughput_tok_s, "output_tokens": result.total_output_tokens,
            "tpot_p50_ms": result.tpot.p50_ms}


def start_servers(stack: ExitStack, configs: dict[str, dict | None], tag: str) -> dict[str, str]:
    """name -> base URL of a `shardserve serve` of the embedded model dequantized to bfloat16 with that
    speculative config (None: none), loaded one at a time and warmed up; stopped with `stack`."""
    servers = {}
    for name, config in configs.items():
        port = free_port()
        cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", "bfloat16", "--quantization", "none",
               "--port", str(port),
               "--kv-cache-memory", str(1 << 30), "--max-model-len", "2048", "--log-level", "warning"]
        if config:
            cmd += ["--speculative-config", json.dumps(config)]
        servers[name] = stack.enter_context(started(tag, name, cmd, port))
        warm_up(servers[name], salt=7)
    return servers


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = dict.fromkeys(SPEC_METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def delta(after: dict, before: dict) -> dict:
    return {name.removeprefix("vllm:spec_decode_").removesuffix("_total"): after[name] - before[name]
            for name in SPEC_METRICS}


def busy_level(url: str, config: WorkloadConfig, temperature: float) -> dict:
    if temperature == 0:
        return run_level(url, config, 32)
    # one seed for every request: each server draws the same tokens for the same prompt (the
    # draw is a function of seed and position), so the three decode the same text
    result = run_benchmark_sync(url, build_workload(config), concurrency=32, temperature=temperature,
                                show_progress=False, extra_body={"seed": 1234})
    if result.num_failed:
        raise RuntimeError(f"{result.num_failed} requests failed at {url}: {result.error_samples}")
    return {"output_tok_s": result.output_throughput_tok_s, "output_tokens": result.total_output_tokens,
            "tpot_p50_ms": result.tpot.p50_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per block")
    parser.add_argument("--busy-requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=256, help="reuse answers' limit")
    parser.add_argument("--quick", action="store_true", help="1 round, 32 busy requests, 64-token answers")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.busy_requests, args.max_tokens = 1, 32, 64
    servers: dict[str, str] = {}
    runs: dict[str, dict[str, list[dict]]] = {block: {name: [] for name in SERVERS} for block in BLOCKS}
    spec: dict[str, dict[str, dict]] = {block: {} for block in BLOCKS}
    with ExitStack() as stack:
        servers.update(start_servers(stack, SERVERS, TAG))
        prompts = [chat_prompt_ids(servers["off"], task) for task in reuse_tasks()]
        log(TAG, f"checking that {len(prompts)} greedy answers are the same with speculation on and off")
        expected = answers(servers["off"], prompts, args.max_tokens)
        same = [a == b for a, b in zip(expected, answers(servers["ngram"], prompts, args.max_tokens))]
        for block, (concurrency, temperature) in BLOCKS.items():
            before = {name: spec_counters(url) for name, url in servers.items() if SERVERS[name]}
            for round_ in range(args.rounds):
                order = list(servers.items())  # reversed every other round: a drifting host favours no one
                for name, url in (order if round_ % 2 == 0 else order[::-1]):
                    log(TAG, f"[{name}] {block}, round {round_ + 1}")
                    if block == "reuse":
                        runs[block][name].append(reuse_level(url, prompts, args.max_tokens))
                    else:
                        config = WorkloadConfig(num_requests=args.busy_requests, input_len=128, output_len=128,
                                                seed=round_, prompt_salt=len(block))
                        runs[block][name].append(busy_level(url, config, temperature))
            spec[block] = {name: delta(spec_counters(url), before[name]) for name, url in servers.items() if SERVERS[name]}

    def mean_tok_s(block: str, name: str) -> float:
        return statistics.fmean(r["output_tok_s"] for r in runs[block][name])

    def ratio(block: str, name: str) -> float:
        return mean_tok_s(block, name) / mean_tok_s(block, "off")

    def acceptance(counts: dict) -> float:
        return counts["num_accepted_tokens"] / max(counts["num_draft_tokens"], 1)

    print(f"{'block':<14}" + "".join(f"{name + ' tok/s':>14}" for name in SERVERS)
          + "".join(f"{name + '/off':>12}" for name in SERVERS if SERVERS[name]) + "   acceptance, verifications (ngram; always)")
    for block, (concurrency, temperature) in BLOCKS.items():
        label = f"{block} c={concurrency}"
        counts = "; ".join(f"{acceptance(spec[block][name]):.2f}, {spec[block][name]['num_drafts']:.0f}"
                           for name in SERVERS if SERVERS[name])
        print(f"{label:<14}" + "".join(f"{mean_tok_s(block, name):>14.1f}" for name in SERVERS)
              + "".join(f"{ratio(block, name):>12.3f}" for name in SERVERS if SERVERS[name]) + f"   {counts}")
    print(f"greedy answers identical with speculation on and off: {sum(same)}/{len(same)}")
    summary = {
        "ngram_speedup_c1": round(ratio("reuse", "ngram"), 3),
        "busy_ratio_c32": round(ratio("busy", "ngram"), 3),
        "acceptance_rate": round(acceptance(spec["reuse"]["ngram"]), 3),
        "busy_sampled_ratio_c32": round(ratio("busy_sampled", "ngram"), 3),
        "always_busy_sampled_ratio_c32": round(ratio("busy_sampled", "always"), 3),
        "always_speedup_c1": round(ratio("reuse", "always"), 3),
        "busy_acceptance_rate": round(acceptance(spec["busy"]["ngram"]), 3),
        "busy_sampled_acceptance_rate": round(acceptance(spec["busy_sampled"]["always"]), 3),
        "identical_answers": f"{sum(same)}/{len(same)}",
        "tok_s": {block: {name: round(mean_tok_s(block, name), 1) for name in SERVERS} for block in BLOCKS},
        "spec_counters": spec, "rounds": args.rounds, "servers": SERVERS,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("speculative_quick.json" if args.quick else "speculative.json")).write_text(
        json.dumps({**summary, "runs": runs}, indent=1))
    print("RESULT " + json.dumps({k: v for k, v in summary.items() if k not in ("spec_counters", "servers")}))


if __name__ == "__main__":
    main()
