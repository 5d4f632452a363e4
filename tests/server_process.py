"""Start a real `shardserve serve` process on a free port for tests; always cleaned up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(*args: str, startup_timeout_s: float = 120):
    """Yields (base_url, Popen). The process gets its own session so it and any children die."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", *args, "--port", str(port), "--log-level", "warning"]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.3)
        yield base_url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()


def scrape(base_url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in the server's /metrics."""
    total, found = 0.0, False
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total
