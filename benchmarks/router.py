"""Router benchmark: what the router costs, and what prefix-aware routing buys.

(a) Overhead, against a fast fake backend (a tiny FastAPI app in a child process that answers
    a streamed completion at once: three chunks and [DONE]):
      added_p50_ms / added_p99_ms  latency percentiles of 400 sequential streamed requests through
                                   `shardserve route`, minus the same sent to the backend directly
      max_rps                      requests/s through the router with 64 concurrent clients for 5 s
(b) Prefix-aware versus round robin, with 4 real replicas (`shardserve serve smollm2`, bfloat16,
    one torch thread each: four replicas share two cores): groups of
    requests share a long prompt prefix (12 groups x 5 requests, 512 shared + 16 own tokens,
    8 output tokens, Poisson arrivals at 1.5 req/s, groups interleaved at random). Round robin
    spreads a group over every replica, so each replica pays the group's prefill once; prefix-aware
    routing keeps a group on one replica, whose prefix cache then serves the rest. Each policy gets
    fresh prefixes, so neither finds the other's cache warm. Reported: TTFT p50 and output tok/s,
    and prefix_ttft_p50_gain = 1 - prefix-aware TTFT p50 / round-robin TTFT p50.

Run
    .venv/bin/python benchmarks/router.py [--skip-prefix]
    The last line is `RESULT {"added_p50_ms", "added_p99_ms", "max_rps", "prefix_ttft_p50_gain", ...}`,
    also saved as benchmarks/results/router.json. Targets: added p50 <= 2 ms, gain >= 0.3. Run it
    alone: this host has 2 cores, and the router, the backends and the client share them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"


# --- the fake backend ------------------------------------------------------------------------------
def fake_backend_app():
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
             "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None, "token_ids": [7]}]}
    last = json.loads(json.dumps(chunk))
    last["choices"][0]["finish_reason"] = "length"
    events = [f"data: {json.dumps(c)}\n\n" for c in (chunk, chunk, last)] + ["data: [DONE]\n\n"]

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions():
        async def stream():
            for event in events:
                yield event
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextmanager
def process(cmd: list[str], port: int, env: dict | None = None):
    from shardserve.server.process import server_process

    with server_process(cmd, port, startup_timeout_s=180, env=env) as (url, proc):
        yield url


def start_router(stack: ExitStack, replicas: list[str], policy: str) -> str:
    from shardserve.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "route", "--port", str(port), "--policy", policy,
           "--max-outstanding-per-replica", "256", *[a for url in replicas for a in ("--replica", url)]]
    return stack.enter_context(process(cmd, port))


# --- (a) overhead ----------------------------------------------------------------------------------
async def sequential_latencies_s(url: str, num: int) -> list[float]:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0}
    latencies = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(num + 20):
            start = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
            if i >= 20:  # warm-up: connections, first-call paths
                latencies.append(time.perf_counter() - start)
    return latencies


async def max_rps(url: str, concurrency: int, duration_s: float) -> float:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0}
    done = 0
    deadline = time.perf_counter() + duration_s

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
                if response.status_code == 200:
                    done += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def overhead() -> dict:
    from shardserve.ports import free_port

    with ExitStack() as stack:
        port = free_port()
        backend = stack.enter_context(process([sys.executable, __file__, "--fake-backend", str(port)], port))
        router = start_router(stack, [backend], "least_outstanding")
        print("[router] overhead: sequential requests ...", file=sys.stderr, flush=True)
        direct = asyncio.run(sequential_latencies_s(backend, 400))
        routed = asyncio.run(sequential_latencies_s(router, 400))
        print("[router] overhead: max requests/s ...", file=sys.stderr, flush=True)
        rps = asyncio.run(max_rps(router, 64, 5.0))
    return {
        "direct_p50_ms": 1e3 * percentile(direct, 0.5), "routed_p50_ms": 1e3 * percentile(routed, 0.5),
        "added_p50_ms": 1e3 * (percentile(routed, 0.5) - percentile(direct, 0.5)),
        "added_p99_ms": 1e3 * (percentile(routed, 0.99) - percentile(direct, 0.99)),
        "max_rps": rps,
    }


# --- (b) prefix-aware versus round robin -----------------------------------------------------------
def shared_prefix_workload(seed: int, num_groups: int = 12, per_group: int = 5, prefix_len: int = 512,
                           own_len: int = 16, output_len: int = 8, rate_qps: float = 1.5):
    from shardserve.sim.workload import RequestSpec, poisson_arrivals

    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(num_groups)]
    groups = [g for g in range(num_groups) for _ in range(per_group)]
    rng.shuffle(groups)
    arrivals = poisson_arrivals(len(groups), rate_qps, seed=seed)
    return [RequestSpec(tuple(prefixes[g] + [rng.randrange(100, 40000) for _ in range(own_len)]), None, output_len, t)
            for g, t in zip(groups, arrivals)]


def prefix_routing() -> dict:
    from shardserve.bench.client import run_benchmark_sync
    from shardserve.ports import free_port

    results = {}
    with ExitStack() as stack:
        replicas = []
        for i in range(4):
            port = free_port()
            print(f"[router] starting replica {i + 1}/4 ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "shardserve.cli", "serve", "smollm2", "--dtype", "bfloat16", "--port",
                   str(port), "--kv-cache-memory", str(256 << 20), "--max-model-len", "2048", "--log-level", "warning"]
            replicas.append(stack.enter_context(process(cmd, port, {"OMP_NUM_THREADS": "1"})))
        for seed, policy in enumerate(("round_robin", "prefix_aware"), start=1):
            with ExitStack() as router_stack:
                router = start_router(router_stack, replicas, policy)
                print(f"[router] {policy}: 60 requests sharing 12 prefixes ...", file=sys.stderr, flush=True)
                result = run_benchmark_sync(router, shared_prefix_workload(seed), show_progress=False, timeout_s=300)
                if result.num_failed:
                    sys.exit(f"{policy}: {result.num_failed} requests failed: {result.error_samples}")
                results[policy] = {"ttft_p50_ms": result.ttft.p50_ms, "ttft_p90_ms": result.ttft.p90_ms,
                                   "output_tok_s": result.output_throughput_tok_s}
    gain = 1 - results["prefix_aware"]["ttft_p50_ms"] / results["round_robin"]["ttft_p50_ms"]
    return {"prefix_ttft_p50_gain": gain, "policies": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-prefix", action="store_true", help="only part (a)")
    parser.add_argument("--fake-backend", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_backend is not None:
        import uvicorn

        uvicorn.run(fake_backend_app(), host="127.0.0.1", port=args.fake_backend, log_level="warning")
        return
    result = overhead()
    print(f"(a) overhead: direct p50 {result['direct_p50_ms']:.2f} ms, through the router {result['routed_p50_ms']:.2f} ms: "
          f"added p50 {result['added_p50_ms']:.2f} ms, p99 {result['added_p99_ms']:.2f} ms; "
          f"max {result['max_rps']:.0f} req/s through the router")
    if not args.skip_prefix:
        prefix = prefix_routing()
        result.update(prefix)
        for policy, figures in prefix["policies"].items():
            print(f"(b) {policy:<13} TTFT p50 {figures['ttft_p50_ms']:.0f} ms, p90 {figures['ttft_p90_ms']:.0f} ms, "
                  f"{figures['output_tok_s']:.1f} output tok/s")
        print(f"(b) prefix-aware TTFT p50 gain over round robin: {prefix['prefix_ttft_p50_gain']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router.json").write_text(json.dumps(result, indent=1))
    summary = {k: round(v, 3) for k, v in result.items() if isinstance(v, float)}
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
