"""Run a server as a child process until it answers `/health`, and always stop it (and its
children) afterwards. Used by tests and benchmarks; the cluster supervisor will build on it."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import httpx


@contextmanager
def server_process(cmd: list[str], port: int, startup_timeout_s: float = 120, env: dict[str, str] | None = None,
                   headers: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `cmd` (which must listen on `port`), wait for `GET /health` == 200 (sent with
    `headers`: a server behind an API key), yield (base_url, process); `env` adds to the environment. The process leads its own session, so stopping it stops its children.
    Its output goes to a temporary file (a pipe nobody reads could fill and stall it); the file's
    tail is in the error when the process dies or never becomes healthy."""
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
        try:
            _wait_healthy(proc, base_url, startup_timeout_s, log, headers)
            yield base_url, proc
        finally:
            _stop(proc)


def _wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, log, headers: dict | None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}: {_tail(log)}")
        try:
            if httpx.get(f"{base_url}/health", headers=headers, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} did not become healthy in {timeout_s:.0f} s: {_tail(log)}")
        time.sleep(0.3)


def _tail(log, num_chars: int = 2000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-num_chars:]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
