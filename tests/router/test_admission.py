"""Admission at the router, end to end: overload is shed with 429s (and nothing breaks); batch
work fills idle capacity and is deferred while interactive work is in flight."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from tests.router.fleet import replicas, router


def test_ten_times_capacity_gets_429s_and_accepted_requests_finish(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 2) as fleet:
        with router([u for u, _ in fleet], "--max-outstanding-per-replica", "4") as (router_url, _):
            capacity = 2 * 4

            async def one(client: httpx.AsyncClient, i: int) -> int:
                body = {"model": model, "prompt": f"Request {i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                response = await client.post(f"{router_url}/v1/completions", json=body, timeout=120)
                if response.status_code == 200:
                    assert response.json()["usage"]["completion_tokens"] == 24
                elif response.status_code == 429:
                    assert response.headers.get("retry-after")
                    assert response.json()["error"]["code"] == "rate_limit_exceeded"
                return response.status_code

            async def flood() -> list[int]:
                async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
                    return await asyncio.gather(*(one(client, i) for i in range(10 * capacity)))

            codes = asyncio.run(flood())
            accepted, shed = codes.count(200), codes.count(429)
            print(f"\n{10 * capacity} concurrent requests for a capacity of {capacity}: {accepted} served, {shed} got 429")
            assert accepted + shed == len(codes)  # nothing else: no 5xx, no crash
            assert accepted >= capacity and shed > 0
            assert httpx.get(f"{router_url}/health").status_code == 200
            assert all(httpx.get(f"{url}/health").status_code == 200 for url, _ in fleet)


BATCH = {"X-Request-Class": "batch"}
NUM_TOKENS = 16


async def status_in_flight(client: httpx.AsyncClient, router_url: str) -> int:
    replicas = (await client.get(f"{router_url}/admin/status")).json()["replicas"]
    return sum(r["outstanding"] for r in replicas)


async def until_in_flight(client: httpx.AsyncClient, router_url: str, num: int, timeout_s: float = 60) -> None:
    """Wait for the router to hold `num` requests (a condition; the limit only ends a broken run)."""
    deadline = time.monotonic() + timeout_s
    while (have := await status_in_flight(client, router_url)) != num:
        assert time.monotonic() < deadline, f"{have} requests in flight at the router, not {num}"
        await asyncio.sleep(0.05)


def test_batch_backlog_is_deferred_while_interactive_requests_are_in_flight(tiny_checkpoints):
    """A real router and replica: batch requests are served while nothing interactive runs; while
    interactive requests are in flight they are all admitted (beside the batch work already
    running) and batch requests get 429 with Retry-After; then every request completes. The
    replica is frozen (SIGSTOP) while requests pile up on it, so which requests are in flight
    never depends on timing: the test asserts counts and codes only. The rule itself, on every
    interleaving, is tests/router/test_admission_rules.py's."""
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 1) as fleet:
        replica_url, replica = fleet[0]
        # probes of the frozen replica must wait, not eject it: it is the only one
        with router([replica_url], "--max-outstanding-per-replica", "32", "--probe-timeout", "120") as (router_url, _):
            codes = asyncio.run(backlog_then_interactive(router_url, model, replica.pid))
    print(f"\nbatch backlog beside interactive requests: {codes}")
    assert codes["interactive"] == [200] * 6
    assert codes["batch_in_flight"] == [200, 200]  # admitted before the interactive work came
    assert codes["batch_deferred"] == [(429, "5")] * 3
    assert codes["backlog"] == [200] * 8  # 8 < half the capacity of 32: all admitted


async def backlog_then_interactive(router_url: str, model: str, replica_pid: int) -> dict[str, list]:
    def body(name: str) -> dict:
        return {"model": model, "prompt": name, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}

    async def send(name: str, headers: dict | None = None) -> httpx.Response:
        response = await client.post(f"{router_url}/v1/completions", json=body(name), headers=headers, timeout=120)
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == NUM_TOKENS
        return response

    codes: dict[str, list] = {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        # a backlog of batch work with nothing interactive in flight: all of it is served
        backlog = [send(f"Batch job {w}-{i}", BATCH) for w in range(4) for i in range(2)]
        codes["backlog"] = [r.status_code for r in await asyncio.gather(*backlog)]
        await until_in_flight(client, router_url, 0)
        os.killpg(replica_pid, signal.SIGSTOP)
        try:
            batch = [asyncio.ensure_future(send(f"Batch job {i}", BATCH)) for i in range(2)]
            await until_in_flight(client, router_url, 2)  # the batch work is on the (frozen) replica
            interactive = [asyncio.ensure_future(send(f"Interactive {i}")) for i in range(6)]
            await until_in_flight(client, router_url, 8)  # all admitted beside it
            deferred = [await send(f"Batch job late {i}", BATCH) for i in range(3)]
            codes["batch_deferred"] = [(r.status_code, r.headers.get("retry-after")) for r in deferred]
        finally:
            os.killpg(replica_pid, signal.SIGCONT)
        codes["batch_in_flight"] = [r.status_code for r in await asyncio.gather(*batch)]
        codes["interactive"] = [r.status_code for r in await asyncio.gather(*interactive)]
    return codes
