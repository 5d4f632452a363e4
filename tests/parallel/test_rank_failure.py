"""A parallel replica that loses a rank mid-generation fails fast and leaves no process behind.

A real `shardserve serve --tp 2 --pp 2` (4 ranks: the server is rank 0 and spawns ranks 1-3)
streams a long completion to the official openai client; after a few tokens one rank is
SIGKILLed. Killing a worker: the stream ends with an error, the server exits 1 within 30 s, and
the surviving ranks are gone. Killing the driver: its spawned ranks are gone within 30 s.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import psutil
import pytest

from shardserve.ports import free_port

EXIT_WITHIN_S = 30.0
# the hung-rank test waits the collective timeout out: its replica uses 6 s instead of the CLI's
# 20 s (still three idle heartbeats). The killed-rank tests keep 20 s, above FAIL_FAST_S, so they
# show that a dead rank is seen on its closed connections, not by the timeout.
HUNG_COMM_TIMEOUT_S = 6.0
# below the default comm_timeout_s (20 s): the loss is seen on the closed connections, and no survivor is
# left waiting out the timeout in a receive from a rank that gave up
FAIL_FAST_S = 15.0
TOKENS_BEFORE_KILL = 3


@contextmanager
def parallel_server(model: Path, log_path: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`shardserve serve MODEL --tp 2 --pp 2` leading its own session; its whole process group
    is SIGKILLed on the way out, whatever the test did."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", str(model), "--tp", "2", "--pp", "2",
           "--kv-cache-memory", str(1 << 22), "--port", str(port), "--log-level", "warning", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base_url, log_path)
        yield base_url, proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not healthy in {timeout_s:.0f} s: {log_path.read_text()[-2000:]}")


def spawned_ranks(server: psutil.Process) -> list[psutil.Process]:
    """Ranks 1..3 in rank order: torch.multiprocessing spawns them one after another."""
    ranks = [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]
    return sorted(ranks, key=lambda p: (p.create_time(), p.pid))


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_all_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Poll until none of `procs` runs (zombies count as gone); returns those left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (alive := still_running(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def stream_and_kill(base_url: str, model: Path, victim: psutil.Process) -> float:
    """Stream a completion that would run for hundreds of tokens; SIGKILL `victim` once a few
    tokens arrived; return the kill's time.monotonic() when the stream ends (it must end with an
    error, within the client's timeout)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=EXIT_WITHIN_S)
    stream = client.completions.create(model=str(model), prompt="The quick brown fox", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    num_chunks, killed_at = 0, None
    with pytest.raises(openai.APIError):
        for _ in stream:
            num_chunks += 1
            if num_chunks == TOKENS_BEFORE_KILL:
                victim.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None, f"the stream failed after {num_chunks} chunks, before the kill"
    return killed_at


@pytest.mark.parametrize("victim_rank", [1, 3], ids=["driver-tp-peer", "last-stage"])
def test_killed_worker_fails_the_stream_and_the_replica_exits(tiny_checkpoints, tmp_path, victim_rank):
    model, log_path = tiny_checkpoints["llama"], tmp_path / "serve.log"
    with parallel_server(model, log_path) as (base_url, proc):
        server = psutil.Process(proc.pid)
        ranks = spawned_ranks(server)
        assert len(ranks) == 3
        tree = server.children(recursive=True)  # the ranks and multiprocessing's resource tracker
        killed_at = stream_and_kill(base_url, model, ranks[victim_rank - 1])
        returncode = proc.wait(EXIT_WITHIN_S - (time.monotonic() - killed_at))
        exited_after_s = time.monotonic() - killed_at
        left = wait_all_gone(tree, EXIT_WITHIN_S - exited_after_s)
        all_gone_after_s = time.monotonic() - killed_at
        output = log_path.read_text()
        assert returncode == 1, output[-3000:]
        assert "lost a rank of this replica" in output
        assert not left, f"left behind: {[p.pid for p in left]}"
        assert all_gone_after_s < FAIL_FAST_S, f"the replica took {all_gone_after_s:.1f} s to go"


def test_killed_driver_takes_its_ranks_along(tiny_checkpoints, tmp_path):
    model, log_path = tiny_checkpoints["llama"], tmp_path / "serve.log"
    with parallel_server(model, log_path) as (base_url, proc):
        server = psutil.Process(proc.pid)
        assert len(spawned_ranks(server)) == 3
        tree = server.children(recursive=True)
        killed_at = stream_and_kill(base_url, model, server)
        assert proc.wait(5) == -signal.SIGKILL
        left = wait_all_gone(tree, EXIT_WITHIN_S)
        all_gone_after_s = time.monotonic() - killed_at
        assert not left, f"left behind {all_gone_after_s:.0f} s after the kill: {[p.pid for p in left]}"
        assert all_gone_after_s < FAIL_FAST_S, f"the ranks took {all_gone_after_s:.1f} s to go"


def test_hung_worker_is_detected_by_the_timeout(tiny_checkpoints, tmp_path):
    """A rank that stops answering (SIGSTOP) is caught by the collective timeout: the stream
    fails, the server exits 1 and every rank, the stopped one included, is gone within 30 s."""
    model, log_path = tiny_checkpoints["llama"], tmp_path / "serve.log"
    with parallel_server(model, log_path, "--comm-timeout", str(HUNG_COMM_TIMEOUT_S)) as (base_url, proc):
        server = psutil.Process(proc.pid)
        ranks = spawned_ranks(server)
        tree = server.children(recursive=True)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=str(model), prompt="The quick brown fox", max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        stopped_at = None
        with pytest.raises(openai.APIError):
            for num_chunks, _ in enumerate(stream, 1):
                if num_chunks == TOKENS_BEFORE_KILL:
                    ranks[-1].send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        assert stopped_at is not None
        assert proc.wait(EXIT_WITHIN_S - (time.monotonic() - stopped_at)) == 1
        left = wait_all_gone(tree, EXIT_WITHIN_S - (time.monotonic() - stopped_at))
        assert not left, f"left behind: {[p.pid for p in left]}"
        print(f"hung rank detected; everything gone {time.monotonic() - stopped_at:.1f} s after SIGSTOP")
