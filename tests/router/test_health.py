"""A replica that stops answering (SIGSTOP: its process frozen, its sockets open) is ejected by
the health probes, its streams resume elsewhere, and once it answers again it is probed and
readmitted. The stall timer is set far beyond the wait for the ejection, so only the probes can
have ejected it; how many failed probes eject a replica, each bounded by the probe timeout, is
tests/router/test_health_checks.py's (with a fake clock: no timing is compared here)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx

from tests.router.fleet import replicas, router
from tests.router.test_failover import run_all
from tests.server_process import scrape

PROBE_INTERVAL_S, PROBE_TIMEOUT_S, EJECT_AFTER = 0.5, 1.0, 2
# EJECT_AFTER failed probes eject it after about EJECT_AFTER x (timeout + interval) = 3 s; the wait
# for it is a generous limit, not a measurement, and the stall timer cannot eject it before then
EJECT_WAIT_S, STALL_TIMEOUT_S = 60.0, 600


def replica_state(router_url: str, url: str) -> str:
    status = httpx.get(f"{router_url}/admin/status", timeout=5).json()
    return next(r["state"] for r in status["replicas"] if r["url"] == url)


def wait_state(router_url: str, url: str, wanted: str, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if replica_state(router_url, url) == wanted:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{url} not {wanted} after {timeout_s:.1f} s (is {replica_state(router_url, url)})")


def test_stopped_replica_is_ejected_and_readmitted(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    with replicas(tiny_checkpoints["llama"], 3) as fleet:
        urls = [url for url, _ in fleet]
        args = ["--policy", "round_robin", "--probe-timeout", str(PROBE_TIMEOUT_S), "--eject-after-failures",
                str(EJECT_AFTER), "--stall-timeout", str(STALL_TIMEOUT_S)]  # the probes must catch it
        with router(urls, *args) as (router_url, _):
            reference = asyncio.run(run_all(router_url, model))
            victim_url, victim = fleet[2]
            ejected_after: list[float] = []
            watcher: list[threading.Thread] = []

            def stop_midway(num_chunks: int) -> None:
                if not watcher and num_chunks >= 600:
                    os.killpg(victim.pid, signal.SIGSTOP)
                    watcher.append(threading.Thread(target=watch, args=(time.monotonic(),)))
                    watcher[0].start()

            def watch(stopped_at: float) -> None:
                with contextlib.suppress(AssertionError):
                    wait_state(router_url, victim_url, "ejected", EJECT_WAIT_S)
                    ejected_after.append(time.monotonic() - stopped_at)

            faulted = asyncio.run(run_all(router_url, model, stop_midway))
            watcher[0].join()
            assert [t for t, _, _ in faulted] == [t for t, _, _ in reference]  # no stream lost
            assert ejected_after, f"not ejected within {EJECT_WAIT_S:.0f} s"
            os.killpg(victim.pid, signal.SIGCONT)
            readmitted_after_s = wait_state(router_url, victim_url, "healthy", 40.0)
            served = scrape(victim_url, "vllm:request_success_total")
            asyncio.run(run_all(router_url, model))  # round robin: a third of these go to it
            assert scrape(victim_url, "vllm:request_success_total") > served
            print(f"\nstopped replica ejected {ejected_after[0]:.1f} s after SIGSTOP (by the probes), "
                  f"its streams resumed elsewhere; readmitted {readmitted_after_s:.1f} s after SIGCONT")
