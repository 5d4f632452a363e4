"""The supervisor's state machine with fake processes and a clock the test moves: restart
backoff, restarting a replica the router keeps ejected, draining on scale-down, and following an
operator's drain. (test_supervisor.py does the same with real processes.)"""
from __future__ import annotations

import asyncio
import itertools
import time

from shardserve.cluster.config import ClusterConfig, ReplicaGroup, SupervisorConfig
from shardserve.cluster.supervisor import Supervisor
from shardserve.config import RouterConfig
from shardserve.router.app import Router

PIDS = itertools.count(1000)


class FakeProcess:
    """Ready at once; exits when the test says (`code`) or when stopped."""

    def __init__(self, group, port, log_path, devices=()):
        self.url, self.pid, self.log_path, self.devices = f"http://127.0.0.1:{port}", next(PIDS), log_path, devices
        self.stop_requested, self.code = False, None

    def exit_code(self):
        return self.code

    async def wait_ready(self, client, timeout_s):
        return None

    async def stop(self, timeout_s):
        self.code = -15 if self.code is None else self.code
        return self.code

    def log_tail(self):
        return "the last line"


SUPERVISOR = SupervisorConfig(restart_backoff_s=1.0, restart_backoff_max_s=4.0, crash_forget_s=100.0,
                              unhealthy_restart_s=5.0, drain_timeout_s=30.0)


def run(tmp_path, scenario, num_replicas: int = 1):
    """`scenario(supervisor, t0)` on an event loop, with the group's replicas serving at t0."""
    async def main():
        router = Router(RouterConfig(probe_timeout_s=0.2))
        group = ReplicaGroup(name="llama", model="m", replicas=num_replicas)
        supervisor = Supervisor(ClusterConfig(RouterConfig(), (group,), SUPERVISOR), router, tmp_path,
                                start_process=FakeProcess)
        t0 = time.monotonic()
        supervisor.tick(t0)
        await settle(supervisor)
        try:
            await scenario(supervisor, t0)
        finally:
            await supervisor.shutdown()
            await router.client.aclose()

    asyncio.run(main())


async def settle(supervisor: Supervisor) -> None:
    """Let the readiness tasks finish (they register with the router: a refused connection)."""
    for _ in range(100):
        if all(m.state != "starting" for m in supervisor.replicas.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("replicas still starting")


def test_a_crashing_replica_is_restarted_with_doubling_backoff(tmp_path):
    async def scenario(supervisor, t0):
        m = supervisor.replicas["llama-1"]
        assert m.state == "serving"
        now, delays = t0, []
        for _ in range(4):
            first_pid = m.process.pid
            m.process.code = 1
            now += 1.0
            supervisor.tick(now)
            assert m.state == "backoff" and m.last_error == "exited with code 1"
            delays.append(m.restart_at_s - now)
            supervisor.tick(m.restart_at_s - 0.01)
            assert m.state == "backoff"
            now = m.restart_at_s
            supervisor.tick(now)
            await settle(supervisor)
            assert m.state == "serving" and m.process.pid != first_pid
        assert delays == [1.0, 2.0, 4.0, 4.0] and m.num_restarts == 4
        # serving for crash_forget_s forgets the crashes: the next restart is quick again
        forget_at = m.serving_since_s + 100.0
        supervisor.tick(forget_at)
        assert m.consecutive_crashes == 0
        m.process.code = 1
        supervisor.tick(forget_at + 1.0)
        assert m.restart_at_s - (forget_at + 1.0) == 1.0

    run(tmp_path, scenario)


def test_a_replica_the_router_keeps_ejected_is_restarted(tmp_path):
    async def scenario(supervisor, t0):
        m = supervisor.replicas["llama-1"]
        process = m.process
        routed = supervisor.router.pool.replicas[process.url]
        routed.state = "ejected"
        supervisor.tick(t0 + 1.0)
        supervisor.tick(t0 + 5.9)
        assert m.state == "serving"
        routed.state = "healthy"  # readmitted in time: the count starts over
        supervisor.tick(t0 + 6.0)
        routed.state = "half_open"
        supervisor.tick(t0 + 7.0)
        supervisor.tick(t0 + 12.0)
        assert m.state == "backoff" and m.last_error == "failed health checks for 5 s"
        await asyncio.sleep(0)
        assert process.stop_requested and supervisor.router.pool.replicas[process.url].state == "draining"

    run(tmp_path, scenario)


def test_scaling_down_drains_the_least_busy_replica_and_stops_it_once_idle(tmp_path):
    async def scenario(supervisor, t0):
        busy, idle = supervisor.replicas["llama-1"], supervisor.replicas["llama-2"]
        pool = supervisor.router.pool
        pool.replicas[busy.process.url].outstanding = 2
        supervisor.targets["llama"] = 1
        supervisor.tick(t0 + 1.0)
        assert (busy.state, idle.state) == ("serving", "draining")
        assert pool.replicas[idle.process.url].state == "draining"  # the router sends it nothing new
        supervisor.tick(t0 + 2.0)
        assert list(supervisor.replicas) == ["llama-1"]
        await asyncio.sleep(0)
        assert idle.process.code == -15  # stopped
        # a replica with requests in flight is waited for, up to drain_timeout_s
        supervisor.retire(busy, t0 + 3.0)
        supervisor.tick(t0 + 20.0)
        assert busy.state == "draining" and busy.process.code is None
        pool.replicas[busy.process.url].outstanding = 0
        supervisor.tick(t0 + 21.0)
        assert "llama-1" not in supervisor.replicas

    run(tmp_path, scenario, num_replicas=2)


def test_a_replica_drained_through_the_router_is_replaced(tmp_path):
    async def scenario(supervisor, t0):
        old = supervisor.replicas["llama-1"]
        supervisor.router.pool.drain(old.process.url)
        supervisor.tick(t0 + 1.0)
        assert old.state == "draining"
        await settle(supervisor)
        assert [m.state for m in supervisor.members("llama")] == ["serving"]
        assert supervisor.members("llama")[0].name == "llama-2"

    run(tmp_path, scenario)
