"""A real `shardserve cluster` process for tests, on a free port with fast probes, and the
helpers the tests share: polling its status and listing every process it owns."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import psutil
import yaml

from shardserve.ports import free_port
from shardserve.server.process import server_process

FAST_ROUTER = {"probe_interval_s": 0.3}
FAST_SUPERVISOR = {"check_interval_s": 0.2, "restart_backoff_s": 0.2, "stop_timeout_s": 10.0}


def tiny_group(model: Path, **fields) -> dict:
    """A group of the tiny test model; replicas log only warnings."""
    return {"name": "llama", "model": str(model), "replicas": 1,
            "serve_args": ["--kv-cache-memory", str(16 << 20), "--log-level", "warning"], **fields}


@contextmanager
def running_cluster(tmp_path: Path, groups: list[dict], router: dict | None = None,
                    supervisor: dict | None = None) -> Iterator[tuple[str, object]]:
    """Start the cluster and wait until every group has its replicas serving; yields (url, Popen)."""
    port = free_port()
    config = {"router": {**FAST_ROUTER, **(router or {}), "port": port},
              "supervisor": {**FAST_SUPERVISOR, "log_dir": str(tmp_path / "logs"), **(supervisor or {})},
              "groups": groups}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "shardserve.cli", "cluster", "--config", str(path)]
    with server_process(cmd, port) as (url, proc):
        wanted = sum(g.get("replicas", 1) for g in groups)
        wait_for(lambda: len(serving(url)) == wanted, 60, f"{wanted} replicas serving")
        yield url, proc


def status(url: str) -> dict:
    return httpx.get(f"{url}/admin/cluster", timeout=10).json()


def serving(url: str) -> list[dict]:
    return [r for r in status(url)["replicas"] if r["state"] == "serving"]


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2):
    """Poll `condition` until it is truthy; returns its value. Fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its descendants (a replica's spawned ranks too)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running
