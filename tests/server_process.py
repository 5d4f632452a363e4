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
    return scrape_many(base_url, (name,), default)[name]


def scrape_many(base_url: str, names: tuple[str, ...], default: float | None = None,
                client: httpx.Client | None = None) -> dict[str, float]:
    """`scrape` of several metrics from one read of /metrics (through `client`, a kept-alive
    connection, when given)."""
    totals: dict[str, float] = {}
    text = (client.get(f"{base_url}/metrics") if client else httpx.get(f"{base_url}/metrics", timeout=5)).text
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    for name in names:
        if name not in totals:
            if default is None:
                raise KeyError(name)
            totals[name] = default
    return totals
