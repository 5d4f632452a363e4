"""One `shardserve serve` child process of the cluster: its command line, start, readiness and
stop. The supervisor decides when; this module only does.

Each replica leads its own session (its spawned ranks are in it too), so a stop reaches every
rank, and it dies with the cluster process: it gets SIGTERM (PR_SET_PDEATHSIG) if the cluster is
killed without a chance to stop it, so no replica outlives its supervisor.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shardserve.cluster.config import ReplicaGroup

REPLICA_HOST = "127.0.0.1"  # replicas are reached only through the router on this host
PR_SET_PDEATHSIG = 1


def serve_command(group: ReplicaGroup, port: int) -> list[str]:
    layout = group.layout
    return [sys.executable, "-m", "shardserve.cli", "serve", group.model, "--host", REPLICA_HOST, "--port", str(port),
            "--tp", str(layout.tp), "--pp", str(layout.pp), "--ep", str(layout.ep), "--dtype", group.dtype,
            *group.serve_args]


class ReplicaProcess:
    """A started replica process. `devices` are the GPU ids it may use (none: not restricted)."""

    def __init__(self, group: ReplicaGroup, port: int, log_path: Path, devices: tuple[int, ...] = ()):
        self.group, self.port, self.log_path, self.devices = group, port, log_path, devices
        self.url = f"http://{REPLICA_HOST}:{port}"
        env = dict(os.environ)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(serve_command(group, port), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                          preexec_fn=_die_with_parent())
        self.pid = self.popen.pid
        self.stop_requested = False  # set by the supervisor when it first asks this process to stop

    def exit_code(self) -> int | None:
        return self.popen.poll()

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float) -> str | None:
        """Poll /health until 200: None when ready, else why not (exited, timed out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.exit_code()
            if code is not None:
                return f"exited with code {code} while starting"
            try:
                if (await client.get(f"{self.url}/health", timeout=2.0)).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return f"not healthy after {timeout_s:.0f} s"
            await asyncio.sleep(0.25)

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM the replica's session (graceful: it finishes what it can); SIGKILL after
        `timeout_s`. Returns the exit code."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.exit_code() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.exit_code() is None:
            self._signal(signal.SIGKILL)
            while self.exit_code() is None:
                await asyncio.sleep(0.05)
        self._signal(signal.SIGKILL)  # ranks that outlived their leader, if any
        return self.popen.returncode

    def log_tail(self, num_chars: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - num_chars))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the whole session is gone already


def _die_with_parent():
    """A preexec_fn that asks the kernel to SIGTERM the child when its parent dies. The libc
    function is looked up here, in the parent: the child, between fork and exec, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec
