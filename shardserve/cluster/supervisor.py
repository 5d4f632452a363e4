"""The supervisor: keeps each replica group at its target count of healthy replicas, and owns
every replica process from start to stop.

A replica's life (one ManagedReplica; a restart is a new process on a new port, same name):

    backoff --due--> starting --/health 200, registered--> serving --retire--> draining --idle--> (stopped)
       ^                |                                    |
       +--- crashed ----+---- exited, or unhealthy for unhealthy_restart_s

    crashed: taken out of the router (its streams resume on other replicas), stopped, and
             started again after restart_backoff_s * 2^(consecutive crashes - 1), capped
    retire:  a serving replica drains (the router sends it nothing new) and is stopped once its
             last request finishes, or after drain_timeout_s; one not yet serving stops at once

Every `check_interval_s` the supervisor checks each replica, asks the autoscaler for each group's
target, and starts or retires replicas to meet it (`reconcile`). A group being resharded
(reshard.py) is left alone by the autoscaler and by reconcile until the reshard ends.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shardserve.cluster.autoscaler import AutoscaleState, GroupLoad, decide
from shardserve.cluster.config import ClusterConfig, ReplicaGroup
from shardserve.cluster.devices import DevicePool
from shardserve.cluster.replica_process import ReplicaProcess
from shardserve.router.app import Router
from shardserve.router.replica_pool import ReplicaState
from shardserve.ports import free_port

log = logging.getLogger(__name__)

DEVICE_RETRY_S = 1.0


class MemberState(enum.StrEnum):
    """Where a supervised replica is in its life (the diagram above). A str enum: /admin/cluster
    and the logs show the plain names ("serving")."""

    BACKOFF = "backoff"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"


# counted toward the group's target, in the order reconcile retires a surplus (cheapest to lose first)
ACTIVE_STATES = (MemberState.BACKOFF, MemberState.STARTING, MemberState.SERVING)


@dataclass
class ManagedReplica:
    name: str  # "<group>-<n>", kept across restarts
    group: ReplicaGroup  # what it runs, layout included
    state: MemberState = MemberState.BACKOFF
    process: ReplicaProcess | None = None  # the current (or last) process
    restart_at_s: float = 0.0
    num_restarts: int = 0
    consecutive_crashes: int = 0
    serving_since_s: float | None = None
    unhealthy_since_s: float | None = None
    drain_started_s: float | None = None
    last_error: str | None = None


class Supervisor:
    """`start_process(group, port, log_path, devices)` starts a replica process (tests pass a fake)."""

    def __init__(self, config: ClusterConfig, router: Router, log_dir: Path, start_process=ReplicaProcess):
        self.config, self.router, self.log_dir = config.supervisor, router, log_dir
        self.start_process = start_process
        self.groups = {g.name: g for g in config.groups}
        self.targets = {g.name: g.replicas for g in config.groups}
        self.autoscale_states = {g.name: AutoscaleState() for g in config.groups}
        self.paused: set[str] = set()  # groups under a reshard
        self.replicas: dict[str, ManagedReplica] = {}
        self.devices = DevicePool(config.supervisor.devices)
        self.client = httpx.AsyncClient(headers=router.auth.bearer_header())  # readiness probes
        self.reshard = None  # the last reshard's ReshardProgress (reshard.py)
        self._num_created = 0
        self._background: set[asyncio.Task] = set()  # readiness waits, reshards: cancelled on shutdown
        self._stopping: set[asyncio.Task] = set()  # process stops: awaited on shutdown

    # --- the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - a supervisor that stops supervising is worse
                log.exception("supervisor check failed; continuing")
            await asyncio.sleep(self.config.check_interval_s)

    def tick(self, now: float) -> None:
        for replica in list(self.replicas.values()):
            self._check(replica, now)
        for name in self.groups:
            if name not in self.paused:
                self._autoscale(name, now)
                self.reconcile(name, now)

    def _check(self, m: ManagedReplica, now: float) -> None:
        if m.state == MemberState.BACKOFF and now >= m.restart_at_s:
            self._start(m, now)
        elif m.state == MemberState.SERVING:
            self._check_serving(m, now)
        elif m.state == MemberState.DRAINING:
            routed = self.router.pool.replicas.get(m.process.url)
            idle = routed is None or routed.outstanding == 0
            exited = m.process.exit_code() is not None
            if idle or exited or now - m.drain_started_s >= self.config.drain_timeout_s:
                why = "drained" if idle else "exited while draining" if exited else "drain timed out"
                log.info("replica %s %s; stopping it", m.name, why)
                self._forget(m)

    def _check_serving(self, m: ManagedReplica, now: float) -> None:
        code = m.process.exit_code()
        if code is not None:
            self._crashed(m, f"exited with code {code}", now)
            return
        routed = self.router.pool.replicas.get(m.process.url)
        if routed is None or routed.state == ReplicaState.DRAINING:  # an operator drained it via the router
            log.info("replica %s was drained through the router; replacing it", m.name)
            self.retire(m, now)
            return
        if routed.state == ReplicaState.HEALTHY:
            m.unhealthy_since_s = None
        else:
            if m.unhealthy_since_s is None:
                m.unhealthy_since_s = now
            if now - m.unhealthy_since_s >= self.config.unhealthy_restart_s:
                self._crashed(m, f"failed health checks for {now - m.unhealthy_since_s:.0f} s", now)
                return
        if now - m.serving_since_s >= self.config.crash_forget_s:
            m.consecutive_crashes = 0

    # --- starting, crashing, stopping ---------------------------------------------------------------
    def add_replica(self, group: ReplicaGroup, now: float) -> ManagedReplica:
        """A new replica of `group`, started now."""
        self._num_created += 1
        m = ManagedReplica(name=f"{group.name}-{self._num_created}", group=group)
        self.replicas[m.name] = m
        self._start(m, now)
        return m

    def _start(self, m: ManagedReplica, now: float) -> None:
        devices = self.devices.take(m.group.layout.world_size)
        if devices is None:  # e.g. the previous process still holds them while it stops
            m.last_error = f"waiting for {m.group.layout.world_size} free devices"
            m.restart_at_s = now + DEVICE_RETRY_S
            return
        try:
            process = self.start_process(m.group, free_port(), self.log_dir / f"{m.name}.log", devices)
        except OSError as exc:  # e.g. its log folder is gone: retried like a crash
            self.devices.give_back(devices)
            self._schedule_restart(m, f"could not start: {exc}", now)
            return
        if m.process is not None:
            m.num_restarts += 1
        m.process, m.state = process, MemberState.STARTING
        log.info("replica %s (%s) starting on %s, pid %d", m.name, m.group.layout, process.url, process.pid)
        self.background(self._await_ready(m, process))

    async def _await_ready(self, m: ManagedReplica, process: ReplicaProcess) -> None:
        error = await process.wait_ready(self.client, self.config.startup_timeout_s)
        if m.process is not process or m.state != MemberState.STARTING:
            return  # retired while it started
        if error is not None:
            self._crashed(m, error, time.monotonic())
            return
        routed = self.router.pool.add(process.url)
        await self.router.health.check(routed)  # reads its model card (layout) and load
        if m.process is process and m.state == MemberState.STARTING:
            m.state, m.serving_since_s, m.unhealthy_since_s = MemberState.SERVING, time.monotonic(), None
            log.info("replica %s serving at %s", m.name, process.url)

    def _crashed(self, m: ManagedReplica, reason: str, now: float) -> None:
        tail = m.process.log_tail().splitlines()[-1:] or [""]
        self._schedule_restart(m, reason, now, f" (last log line: {tail[0]})")
        self._stop_process(m.process)

    def _schedule_restart(self, m: ManagedReplica, reason: str, now: float, detail: str = "") -> None:
        m.consecutive_crashes += 1
        delay_s = min(self.config.restart_backoff_max_s,
                      self.config.restart_backoff_s * 2 ** (m.consecutive_crashes - 1))
        log.warning("replica %s %s%s; restarting in %.1f s", m.name, reason, detail, delay_s)
        m.last_error = reason
        m.state, m.restart_at_s, m.serving_since_s = MemberState.BACKOFF, now + delay_s, None

    def retire(self, m: ManagedReplica, now: float) -> None:
        """Take `m` out of service: drain it if it serves, else stop it now."""
        if m.state == MemberState.SERVING:
            self.router.pool.drain(m.process.url)
            m.state, m.drain_started_s = MemberState.DRAINING, now
            log.info("replica %s draining (%d in flight)", m.name, self._outstanding(m))
        elif m.state != MemberState.DRAINING:
            self._forget(m)

    def background(self, coroutine) -> asyncio.Task:
        """Run `coroutine` as a task that shutdown cancels (before it stops the processes)."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _forget(self, m: ManagedReplica) -> None:
        self.replicas.pop(m.name, None)
        if m.process is not None:
            self._stop_process(m.process)

    def _stop_process(self, process: ReplicaProcess) -> None:
        """Out of the router (once idle), then SIGTERM, SIGKILL if needed; devices come back after.
        Once per process: its devices must not be given back twice."""
        if process.stop_requested:
            return
        process.stop_requested = True
        self.router.pool.drain(process.url)

        async def stop() -> None:
            await process.stop(self.config.stop_timeout_s)
            self.devices.give_back(process.devices)

        task = asyncio.ensure_future(stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    # --- group sizes -----------------------------------------------------------------------------------
    def members(self, group_name: str) -> list[ManagedReplica]:
        """The group's replicas that count toward its target (not draining)."""
        return [m for m in self.replicas.values() if m.group.name == group_name and m.state in ACTIVE_STATES]

    def reconcile(self, name: str, now: float) -> None:
        """Start or retire replicas until the group has its target count."""
        members = self.members(name)
        for _ in range(self.targets[name] - len(members)):
            self.add_replica(self.groups[name], now)
        surplus = len(members) - self.targets[name]
        if surplus > 0:  # the cheapest to lose first: not yet serving, then the least busy
            order = sorted(members, key=lambda m: (ACTIVE_STATES.index(m.state), self._outstanding(m)))
            for m in order[:surplus]:
                self.retire(m, now)

    def _autoscale(self, name: str, now: float) -> None:
        policy = self.groups[name].autoscale
        if policy is None:
            return
        decision = decide(policy, self.group_load(name), self.targets[name], self.autoscale_states[name], now)
        self.autoscale_states[name] = decision.state
        if decision.target != self.targets[name]:
            log.info("autoscaling %s: %d -> %d replicas (%s)", name, self.targets[name], decision.target,
                     decision.reason)
            self.targets[name] = decision.target

    def group_load(self, name: str) -> GroupLoad:
        routed = [self.router.pool.replicas.get(m.process.url) for m in self.members(name)
                  if m.state == MemberState.SERVING]
        healthy = [r for r in routed if r is not None and r.state == ReplicaState.HEALTHY]
        if not healthy:
            return GroupLoad(0, 0.0, 0.0)
        return GroupLoad(len(healthy), sum(r.load.num_waiting for r in healthy),
                         sum(r.load.kv_usage for r in healthy) / len(healthy))

    def set_group(self, group: ReplicaGroup, now: float) -> None:
        """Replace a group's spec and target (a reshard's last step); the autoscaler restarts its
        cooldown from now."""
        self.groups[group.name] = group
        self.targets[group.name] = group.replicas
        self.autoscale_states[group.name] = AutoscaleState(last_change_s=now)

    def _outstanding(self, m: ManagedReplica) -> int:
        routed = self.router.pool.replicas.get(m.process.url) if m.process else None
        return routed.outstanding if routed else 0

    # --- views and shutdown -------------------------------------------------------------------------
    def status(self) -> dict:
        groups = [{"name": g.name, "model": g.model, "layout": g.layout.as_dict(), "target_replicas": self.targets[n],
                   "autoscale": dataclasses.asdict(g.autoscale) if g.autoscale else None,
                   "resharding": n in self.paused}
                  for n, g in self.groups.items()]
        replicas = []
        for m in self.replicas.values():
            routed = self.router.pool.replicas.get(m.process.url) if m.process else None
            replicas.append({
                "name": m.name, "group": m.group.name, "layout": m.group.layout.as_dict(), "state": m.state,
                "url": m.process.url if m.process else None, "pid": m.process.pid if m.process else None,
                "devices": list(m.process.devices) if m.process else [],
                "router_state": routed.state if routed else None,
                "outstanding": routed.outstanding if routed else 0, "num_restarts": m.num_restarts,
                "last_error": m.last_error, "log": str(m.process.log_path) if m.process else None})
        return {"groups": groups, "replicas": replicas, "devices_free": self.devices.num_free(),
                "reshard": self.reshard.as_dict() if self.reshard else None}

    async def shutdown(self) -> None:
        """Stop every replica (SIGTERM, then SIGKILL) and wait until all have exited."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for m in list(self.replicas.values()):
            self._forget(m)
        await asyncio.gather(*self._stopping, return_exceptions=True)
        await self.client.aclose()
