"""Real replicas and a real router for the router tests: `shardserve serve` and `shardserve
route` processes on free ports, always cleaned up."""
from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

from shardserve.ports import free_port
from shardserve.server.process import server_process


@contextmanager
def replicas(model: Path, count: int, *args: str):
    """`count` replicas of `model`; yields [(base_url, Popen)]."""
    with ExitStack() as stack:
        started = []
        for _ in range(count):
            port = free_port()
            cmd = [sys.executable, "-m", "shardserve.cli", "serve", str(model), "--port", str(port),
                   "--kv-cache-memory", str(16 << 20), "--log-level", "warning", *args]
            started.append(stack.enter_context(server_process(cmd, port)))
        yield started


@contextmanager
def router(replica_urls: list[str], *args: str):
    """`shardserve route` over `replica_urls`; yields (base_url, Popen)."""
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "route", "--port", str(port), "--probe-interval", "0.5",
           *[arg for url in replica_urls for arg in ("--replica", url)], *args]
    with server_process(cmd, port) as started:
        yield started
