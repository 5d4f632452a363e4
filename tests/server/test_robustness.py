"""Client disconnects, overload and a schema fuzz run against real server processes."""
import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from shardserve.ports import free_port
from tests.server_process import running_server, scrape


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def stream_then_drop(url: str, num_chunks: int) -> int:
    body = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    seen = 0
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= num_chunks:
                        break  # leaving the block closes the connection mid-stream
    return seen


def wait_for(predicate, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_dropped_streams_abort_and_free_kv():
    with running_server("--model", "smollm2", "--kv-cache-memory", str(64 << 20), "--max-model-len", "1024") as (url, _):
        idle_usage = scrape(url, "vllm:kv_cache_usage_perc")

        async def main():
            return await asyncio.gather(*(stream_then_drop(url, 3) for _ in range(20)))

        assert asyncio.run(main()) == [3] * 20
        assert wait_for(lambda: scrape(url, "vllm:num_requests_running") == 0)
        assert wait_for(lambda: scrape(url, "vllm:kv_cache_usage_perc") == idle_usage)
        assert scrape(url, 'vllm:request_success_total') >= 20  # counted with finished_reason="abort"
        assert scrape(url, "vllm:generation_tokens_total") < 20 * 400  # nobody ran to the end


def test_overload_gets_429_and_accepted_requests_complete():
    args = ["--model", "smollm2", "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
            "--max-num-seqs", "4", "--max-waiting-requests", "4"]
    with running_server(*args) as (url, proc):
        rss_before = rss_mib(proc.pid)

        async def one(client: httpx.AsyncClient, i: int):
            r = await client.post(f"{url}/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 8,
                                                                  "ignore_eos": True, "temperature": 0})
            return r.status_code, r.headers.get("retry-after"), r.json()

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(80)))

        results = asyncio.run(main())
        accepted = [body for status, _, body in results if status == 200]
        rejected = [(retry, body) for status, retry, body in results if status == 429]
        assert len(accepted) + len(rejected) == 80 and rejected and accepted
        assert all(retry == "1" and body["error"]["code"] == "rate_limit_exceeded" for retry, body in rejected)
        assert all(body["usage"]["completion_tokens"] == 8 for body in accepted)
        assert httpx.get(f"{url}/health").status_code == 200
        assert rss_mib(proc.pid) - rss_before < 200
        # a single call that could never fit the queue is a client error, not a retry
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("schemathesis", path=os.path.dirname(sys.executable)) is None,
                    reason="schemathesis is not installed")
def test_schema_fuzz_finds_no_server_errors(tiny_checkpoints, tmp_path):
    # the tiny random model keeps each generated request cheap, so hundreds of cases run quickly
    args = ["--model", str(tiny_checkpoints["llama"]), "--kv-cache-memory", str(16 << 20), "--max-model-len", "256"]
    with running_server(*args) as (url, _):
        cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{url}/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", "60", "--request-timeout", "60",
               "--generation-deterministic", "--suppress-health-check", "all"]
        # run from a temp folder: schemathesis keeps a cache in its working directory
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        tail = proc.stdout[-3000:]
        assert proc.returncode == 0, tail
        generated = re.search(r"(\d+) generated", proc.stdout)
        assert generated and int(generated.group(1)) >= 200, tail
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_taken_port_ends_the_server_instead_of_leaving_it_headless(tiny_checkpoints):
    """uvicorn cannot bind: the replica exits 1 with the reason, rather than running an engine
    nobody can reach (a supervisor then restarts it on another port)."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run([sys.executable, "-m", "shardserve.cli", "serve", str(tiny_checkpoints["llama"]),
                               "--port", str(port), "--kv-cache-memory", str(4 << 20), "--log-level", "warning"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "address already in use" in proc.stderr


def test_free_ports_stay_out_of_the_ephemeral_range():
    """Outgoing connections (the gloo mesh between ranks, say) take ephemeral ports: a port
    picked from that range could be gone before its server binds it."""
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert not any(low <= free_port() <= high for _ in range(200))
