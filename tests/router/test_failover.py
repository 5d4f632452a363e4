"""Zero-loss failover: a replica SIGKILLed in the middle of 60 concurrent streams costs the
clients nothing: every stream completes, byte-identical to a fault-free run, with no error. A
third of the streams are JSON-schema constrained: a resumed one replays its grammar over the
tokens already streamed, so it is still valid and still the same."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import openai

from tests.router.fleet import replicas, router
from tests.server_process import scrape, scrape_many

NUM_REQUESTS = 60
MAX_TOKENS = 32
CONSTRAINED_MAX_TOKENS = 80  # room for the whole document (the random model writes long strings)
GENERATED, RUNNING = "vllm:generation_tokens_total", "vllm:num_requests_running"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


LONG_PREFIX = " ".join(["the quick brown fox jumps over the lazy dog"] * 24)  # ~400 tokens


def requests(constrained: bool = False, long_prompts: bool = False) -> list[dict]:
    """Half greedy, half seeded sampling; completions and chat; every third one JSON-constrained
    when `constrained`; each prompt after LONG_PREFIX when `long_prompts`."""
    out = []
    for i in range(NUM_REQUESTS):
        sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=1000 + i)
        prompt = f"{LONG_PREFIX if long_prompts else ''}Request {i}: the quick brown fox"
        out.append(dict(kind="chat" if i % 4 < 2 else "completion", prompt=prompt,
                        constrained=constrained and i % 3 == 0, **sampling))
    return out


async def run_all(base_url: str, model: str, on_progress=None, constrained: bool = False,
                  long_prompts: bool = False) -> list[tuple[str, float, float]]:
    """Stream every request concurrently; (text, seconds, longest gap between chunks in seconds)
    each. Any client-visible error raises."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks_seen = [0]

    async def one(spec: dict) -> tuple[str, float, float]:
        start = last = time.monotonic()
        gap = 0.0

        def tick() -> None:
            nonlocal last, gap
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            chunks_seen[0] += 1
            if on_progress:
                on_progress(chunks_seen[0])
        sampling = {k: v for k, v in spec.items() if k in ("temperature", "top_p", "seed")}
        extra, max_tokens = {"ignore_eos": True}, MAX_TOKENS
        if spec["constrained"]:  # the grammar ends it: no ignore_eos
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
            max_tokens = CONSTRAINED_MAX_TOKENS
        if spec["kind"] == "chat":
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": spec["prompt"]}], max_tokens=max_tokens,
                stream=True, extra_body=extra, **sampling)
            pieces = []
            async for chunk in stream:
                pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                tick()
        else:
            stream = await client.completions.create(model=model, prompt=spec["prompt"], max_tokens=max_tokens,
                                                     stream=True, extra_body=extra, **sampling)
            pieces = []
            async for chunk in stream:
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                tick()
        return "".join(pieces), time.monotonic() - start, gap

    try:
        return await asyncio.gather(*(one(spec) for spec in requests(constrained, long_prompts)))
    finally:
        await client.close()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_killed_replica_mid_stream_loses_nothing(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 3) as fleet:
        urls = [url for url, _ in fleet]
        with router(urls, "--policy", "round_robin") as (router_url, _):
            asyncio.run(run_all(router_url, model))  # warm-up: the reference timing is a warm one
            reference = asyncio.run(run_all(router_url, model, constrained=True))
            processes = dict(fleet)
            killed = []
            generated_before = {url: scrape(url, GENERATED, 0.0) for url in urls}

            run_over = threading.Event()
            seen: dict[str, list[tuple[float, float]]] = {url: [] for url in urls}  # (running, generated) polled

            def kill_midway() -> None:
                # the victim: the first replica seen running requests after it generated an eighth of
                # its share of this run's tokens -- mid-stream by its own counters. A thread polls them,
                # not this client's chunk callbacks: the client may lag far behind the replicas (a fast
                # replica can be past its streams' middle before the client's first chunks arrive).
                share = NUM_REQUESTS * MAX_TOKENS / len(urls)
                with httpx.Client(timeout=5) as http:
                    while not run_over.is_set():
                        for url in urls:
                            now = scrape_many(url, (GENERATED, RUNNING), 0.0, http)
                            seen[url].append((now[RUNNING], now[GENERATED] - generated_before[url]))
                            if now[RUNNING] > 0 and now[GENERATED] - generated_before[url] >= share / 8:
                                os.killpg(processes[url].pid, signal.SIGKILL)
                                killed.append({"url": url, "running": now[RUNNING]})
                                return
                        time.sleep(0.005)

            watcher = threading.Thread(target=kill_midway)
            watcher.start()
            try:
                faulted = asyncio.run(run_all(router_url, model, constrained=True))
            finally:
                run_over.set()
                watcher.join()
            assert killed, f"the replica was never killed; (running, generated) polled: {seen}"
            assert [text for text, _, _ in faulted] == [text for text, _, _ in reference]
            for spec, (text, _, _) in zip(requests(constrained=True), faulted):
                if spec["constrained"]:
                    jsonschema.validate(json.loads(text), SCHEMA)
            # the failure's cost to a client: the longest pause in its stream (detection + resume)
            added_p99 = p99([gap for _, _, gap in faulted]) - p99([gap for _, _, gap in reference])
            migrated = scrape(router_url, "shardserve_router_migrations_total", 0.0)
            retried = scrape(router_url, "shardserve_router_retries_total", 0.0)
            print(f"\nfailover: {NUM_REQUESTS} streams all complete and identical; {migrated:.0f} resumed mid-stream, "
                  f"{retried:.0f} retried; added p99 latency {added_p99 * 1e3:.0f} ms (p99 of each stream's longest "
                  f"pause between chunks, {p99([g for _, _, g in reference]) * 1e3:.0f} -> "
                  f"{p99([g for _, _, g in faulted]) * 1e3:.0f} ms; p99 end-to-end "
                  f"{p99([s for _, s, _ in reference]) * 1e3:.0f} -> {p99([s for _, s, _ in faulted]) * 1e3:.0f} ms)")
            assert migrated > 0, f"the killed replica ran {killed[0]['running']:.0f} streams, none resumed"


def wait_idle(router_url: str, replica_urls: list[str], timeout_s: float = 10.0) -> dict:
    """Poll until the router has nothing in flight and the replicas run nothing and hold no KV
    blocks; the last reading either way."""
    deadline, now = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        status = httpx.get(f"{router_url}/admin/status", timeout=5).json()
        now = {"router": {r["url"]: r["outstanding"] for r in status["replicas"]}}
        for url in replica_urls:
            now[url] = scrape_many(url, (RUNNING, "vllm:kv_cache_usage_perc"), 0.0)
        if not any(now["router"].values()) and all(not any(now[url].values()) for url in replica_urls):
            break
        time.sleep(0.1)
    return now


def run_killing(router_url: str, model: str, fleet: list, condition, victims: int = 1,
                **run_kwargs) -> tuple[list, list[str]]:
    """run_all while a thread polls the replicas' counters and SIGKILLs, up to `victims` times,
    the first replica for which `condition(running, generated since the run began, victims so
    far)` holds; (the run's results, the killed urls)."""
    processes, killed, run_over = dict(fleet), [], threading.Event()
    before = {url: scrape(url, GENERATED, 0.0) for url in processes}

    def watch() -> None:
        with httpx.Client(timeout=5) as http:
            while not run_over.is_set() and len(killed) < victims:
                for url in [u for u in processes if u not in killed]:
                    now = scrape_many(url, (GENERATED, RUNNING), 0.0, http)
                    if condition(now[RUNNING], now[GENERATED] - before[url], len(killed)):
                        os.killpg(processes[url].pid, signal.SIGKILL)
                        killed.append(url)
                        break
                time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return asyncio.run(run_all(router_url, model, **run_kwargs)), killed
    finally:
        run_over.set()
        watcher.join()


def test_two_of_three_bf16_replicas_killed_one_after_the_other_lose_nothing(tiny_checkpoints):
    """bfloat16 replicas (the dtype people serve), one SIGKILLed mid-stream and then, once its
    streams run elsewhere, a second: every stream completes byte-identical to the fault-free run
    with no client error, and nothing stays in flight or holds KV blocks afterwards."""
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 3, "--dtype", "bfloat16") as fleet:
        urls = [url for url, _ in fleet]
        with router(urls, "--policy", "round_robin") as (router_url, _):
            asyncio.run(run_all(router_url, model))  # warm-up
            reference = asyncio.run(run_all(router_url, model))
            # each victim: the next replica seen running streams once it generated a sixth of its
            # share of the run per victim so far (its own counters: mid-stream)
            share = NUM_REQUESTS * MAX_TOKENS / len(urls)
            faulted, killed = run_killing(router_url, model, fleet, victims=2, condition=lambda running, generated, n:
                                          running > 0 and generated >= share / 6 * (n + 1))
            assert len(killed) == 2, f"killed {killed} only"
            assert [text for text, _, _ in faulted] == [text for text, _, _ in reference]
            survivors = [url for url in urls if url not in killed]
            idle = wait_idle(router_url, survivors)
            assert not any(idle["router"].values()) and not any(idle[survivors[0]].values()), idle
            assert scrape(router_url, "shardserve_router_migrations_total", 0.0) > 0


def test_a_replica_killed_while_its_requests_are_in_prefill_loses_nothing(tiny_checkpoints):
    """Long prompts prefilled 4 tokens a step (bf16; no prefix cache, or the fault-free run would
    leave the faulted one nothing to prefill): a replica SIGKILLed while it runs requests and has
    generated no token yet. Every stream completes identical to the fault-free run, nothing left
    in flight."""
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 3, "--dtype", "bfloat16", "--max-num-batched-tokens", "4",
                  "--no-prefix-caching") as fleet:
        urls = [url for url, _ in fleet]
        with router(urls, "--policy", "round_robin") as (router_url, _):
            reference = asyncio.run(run_all(router_url, model, long_prompts=True))
            faulted, killed = run_killing(router_url, model, fleet, long_prompts=True,
                                          condition=lambda running, generated, _: running > 0 and generated == 0)
            assert killed, "no replica was seen in prefill"
            assert [text for text, _, _ in faulted] == [text for text, _, _ in reference]
            survivors = [url for url in urls if url not in killed]
            idle = wait_idle(router_url, survivors)
            assert not any(idle["router"].values()) and all(not any(idle[url].values()) for url in survivors), idle
