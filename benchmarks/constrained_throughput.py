"""Structured-output cost: serving throughput with a JSON-schema constraint on every request
against the same requests unconstrained, on one server, at closed-loop concurrency 8 and 32.

One `shardserve serve` of the embedded model. Each level runs twice with the same prompts
(128 random token ids each, distinct per level) at temperature 1, seeded:
    constrained    response_format json_schema (ORDER below: ~190 tokens of JSON at temperature
                   1), max_tokens 512 (room for the longest document it allows); a request
                   ends when its JSON closes
    unconstrained  the same prompts, `ignore_eos`, and max_tokens = the length the same request
                   had constrained: the same tokens to decode, arriving and finishing alike
Throughput is completion tokens (the server's usage) over wall time. Every constrained output is
parsed and checked against the schema (jsonschema).

Run
    .venv/bin/python benchmarks/constrained_throughput.py [--requests 32,96] [--dtype float32]
    Last line: RESULT {"constrained_ratio_c8", "constrained_ratio_c32", "schema_valid_fraction", ...}
    (constrained / unconstrained output tokens per second; also benchmarks/results/constrained_throughput.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import jsonschema

from shardserve.ports import free_port
from shardserve.server.process import server_process

RESULTS = Path(__file__).parent / "results"
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 40},
        "tier": {"enum": ["free", "pro", "enterprise"]}}, "required": ["name", "email", "tier"],
        "additionalProperties": False},
    "items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 16}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "note": {"type": "string", "maxLength": 40}}, "required": ["sku", "quantity", "note"],
        "additionalProperties": False}},
    "priority": {"type": "boolean"}},
    "required": ["customer", "items", "priority"], "additionalProperties": False}
INPUT_LEN = 128


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(INPUT_LEN)] for _ in range(num)]


async def run_level(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    """(completion tokens per second, responses), `concurrency` requests in flight at a time."""
    queue = list(enumerate(bodies))
    replies: list[dict] = [None] * len(bodies)  # type: ignore[list-item]

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            index, body = queue.pop(0)
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            replies[index] = response.json()

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return tokens / wall, replies


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), ORDER)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--requests", default="32,96", help="requests per concurrency level")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    levels = list(zip(map(int, args.concurrency.split(",")), map(int, args.requests.split(","))))
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", args.dtype, "--quantization", "none",
           "--port", str(port),
           "--kv-cache-memory", str(1 << 30), "--max-model-len", "2048", "--log-level", "warning"]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    summary: dict = {"dtype": args.dtype, "levels": {}}
    all_valid = []
    with server_process(cmd, port, startup_timeout_s=180) as (url, _):
        warm = [{"prompt": p, "max_tokens": 32, "temperature": 1.0, "seed": i, "response_format": fmt}
                for i, p in enumerate(prompts(4, 999))]
        asyncio.run(run_level(url, warm, 4))
        for level, (concurrency, num) in enumerate(levels):
            ids = prompts(num, level)
            constrained = [{"prompt": p, "max_tokens": 512, "temperature": 1.0, "seed": i, "response_format": fmt}
                           for i, p in enumerate(ids)]
            c_tok_s, replies = asyncio.run(run_level(url, constrained, concurrency))
            lengths = [r["usage"]["completion_tokens"] for r in replies]
            checks = [valid(r["choices"][0]["text"]) for r in replies]
            all_valid += checks
            mean_len = round(statistics.fmean(lengths))
            free = [{"prompt": p, "max_tokens": n, "temperature": 1.0, "seed": i, "ignore_eos": True}
                    for i, (p, n) in enumerate(zip(ids, lengths))]
            u_tok_s, _ = asyncio.run(run_level(url, free, concurrency))
            ratio = c_tok_s / u_tok_s
            print(f"c={concurrency:<3} constrained {c_tok_s:7.1f} tok/s  unconstrained {u_tok_s:7.1f} tok/s  "
                  f"ratio {ratio:.3f}  mean output {mean_len} tokens  valid {sum(checks)}/{len(checks)}", flush=True)
            summary[f"constrained_ratio_c{concurrency}"] = round(ratio, 3)
            summary["levels"][concurrency] = {"constrained_tok_s": round(c_tok_s, 1), "unconstrained_tok_s": round(u_tok_s, 1),
                                              "mean_output_tokens": mean_len, "num_requests": num,
                                              "valid": sum(checks)}
    summary["schema_valid_fraction"] = round(sum(all_valid) / len(all_valid), 4)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "constrained_throughput.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
