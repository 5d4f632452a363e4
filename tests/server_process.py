"""Start a real `shardserve serve` process on a free port for tests; always cleaned up."""
from __future__ import annotations

import sys
from contextlib import contextmanager

import httpx

from shardserve.ports import free_port
from shardserve.server.process import server_process


@contextmanager
def running_server(*args: str, startup_timeout_s: float = 120, headers: dict[str, str] | None = None):
    """`shardserve serve ARGS` on a free port; yields (base_url, Popen). `headers` go with the
    readiness probes (a server behind an API key)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", *args, "--port", str(port), "--log-level", "warning"]
    with server_process(cmd, port, startup_timeout_s, headers=headers) as (base_url, proc):
        yield base_url, proc


def scrape(base_url: str, name: str, default: float | None = None) -> float:
    """Sum of a metric's samples (all label sets) in the server's /metrics; `default` when it
    has none (KeyError without a default)."""
    total, found = 0.0, False
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        if default is not None:
            return default
        raise KeyError(name)
    return total
