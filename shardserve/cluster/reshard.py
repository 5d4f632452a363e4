"""Live resharding: change a group's layout (and replica count) while it serves, e.g. two tp=1
replicas into one tp=2 replica, without failing a request. A blue-green switch per group:

    1. start the new layout's replicas beside the old ones (so there must be room for both:
       cores, memory, and free devices when the cluster hands out GPUs)
    2. wait until every new replica is healthy and registered: from then on it takes traffic
    3. drain the old replicas: the router sends them nothing new; what they have in flight
       finishes where it is
    4. stop each old replica once it is idle (or after drain_timeout_s: a stream still running
       then resumes on a new replica, through the router's failover)

If a new replica fails to start (it exits, or is not healthy within startup_timeout_s), the
reshard stops there: the new replicas are removed and the old layout serves on, untouched.
While it runs, the group is neither autoscaled nor reconciled.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from dataclasses import dataclass

from shardserve.cluster.config import Layout, ReplicaGroup, check_layout
from shardserve.cluster.supervisor import ManagedReplica, MemberState, Supervisor
from shardserve.config import ConfigError

POLL_S = 0.2


class ReshardError(Exception):
    """A reshard that cannot start; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ReshardState(enum.StrEnum):
    """starting -> draining -> done, or failed (from either). A str enum: /admin/cluster and
    `shardserve cluster reshard`, which polls it, see the plain names."""

    STARTING = "starting"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"

    @property
    def running(self) -> bool:
        return self in (ReshardState.STARTING, ReshardState.DRAINING)


@dataclass
class ReshardProgress:
    group: str
    from_layout: Layout
    from_replicas: int
    to_layout: Layout
    to_replicas: int
    state: ReshardState = ReshardState.STARTING
    error: str | None = None
    started_s: float = dataclasses.field(default_factory=time.monotonic)
    finished_s: float | None = None

    @property
    def running(self) -> bool:
        return self.state.running

    def as_dict(self) -> dict:
        end_s = self.finished_s or time.monotonic()
        return {"group": self.group, "state": self.state, "error": self.error,
                "from": {"layout": self.from_layout.as_dict(), "replicas": self.from_replicas},
                "to": {"layout": self.to_layout.as_dict(), "replicas": self.to_replicas},
                "elapsed_s": round(end_s - self.started_s, 3)}


async def start_reshard(supervisor: Supervisor, group_name: str | None, layout: dict[str, int],
                        num_replicas: int | None) -> ReshardProgress:
    """Check the request and start the reshard in the background. `layout` may give any of tp,
    pp, ep; the others, and the replica count when None, stay as they are. Raises ReshardError."""
    if supervisor.reshard is not None and supervisor.reshard.running:
        raise ReshardError(409, f"a reshard of {supervisor.reshard.group} is still running")
    group = _find_group(supervisor, group_name)
    new_layout = dataclasses.replace(group.layout, **layout)
    num_replicas = group.replicas if num_replicas is None else num_replicas
    if min(new_layout.tp, new_layout.pp, new_layout.ep, num_replicas) < 1:
        raise ReshardError(400, "tp, pp, ep and replicas must be at least 1")
    bounds = group.autoscale
    if bounds and not bounds.min_replicas <= num_replicas <= bounds.max_replicas:
        raise ReshardError(400, f"replicas={num_replicas} is outside the group's autoscale range "
                                f"{bounds.min_replicas}..{bounds.max_replicas}")
    needed = num_replicas * new_layout.world_size
    free = supervisor.devices.num_free()
    if free is not None and needed > free:
        raise ReshardError(409, f"the new layout needs {needed} free devices while the old one serves; {free} are free")
    try:  # reads the checkpoint's headers: off the event loop
        await asyncio.to_thread(check_layout, group.model, new_layout)
    except ConfigError as exc:
        raise ReshardError(400, str(exc)) from None
    progress = ReshardProgress(group.name, group.layout, supervisor.targets[group.name], new_layout, num_replicas)
    supervisor.reshard = progress
    supervisor.background(run_reshard(supervisor, progress,
                                      dataclasses.replace(group, layout=new_layout, replicas=num_replicas)))
    return progress


async def run_reshard(supervisor: Supervisor, progress: ReshardProgress, new_group: ReplicaGroup) -> None:
    name = new_group.name
    supervisor.paused.add(name)
    try:
        new = [supervisor.add_replica(new_group, time.monotonic()) for _ in range(new_group.replicas)]
        error = await _wait_serving(new, supervisor.config.startup_timeout_s)
        if error is not None:
            for m in new:
                supervisor.retire(m, time.monotonic())
            progress.state, progress.error = ReshardState.FAILED, error
            return
        progress.state = ReshardState.DRAINING
        old = [m for m in supervisor.members(name) if m not in new]
        supervisor.set_group(new_group, time.monotonic())
        for m in old:
            supervisor.retire(m, time.monotonic())
        while any(m.name in supervisor.replicas or (m.process and m.process.exit_code() is None) for m in old):
            await asyncio.sleep(POLL_S)  # the supervisor stops each once idle (or at its drain timeout)
        progress.state = ReshardState.DONE
    except asyncio.CancelledError:
        progress.state, progress.error = ReshardState.FAILED, "the cluster stopped during the reshard"
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the status, not lost in a task
        progress.state, progress.error = ReshardState.FAILED, f"{type(exc).__name__}: {exc}"
        raise
    finally:
        supervisor.paused.discard(name)
        progress.finished_s = time.monotonic()


async def _wait_serving(new: list[ManagedReplica], timeout_s: float) -> str | None:
    """None once every new replica serves; else why not. A crash while starting fails the
    reshard at once, rather than after restarts: the layout itself may be what is wrong."""
    deadline = time.monotonic() + timeout_s
    while not all(m.state == MemberState.SERVING for m in new):
        crashed = next((m for m in new if m.consecutive_crashes), None)
        if crashed is not None:
            return f"new replica {crashed.name} did not start: {crashed.last_error}; see {crashed.process.log_path}"
        if time.monotonic() > deadline:
            return f"the new replicas were not all healthy after {timeout_s:.0f} s"
        await asyncio.sleep(POLL_S)
    return None


def _find_group(supervisor: Supervisor, name: str | None) -> ReplicaGroup:
    if name is None:
        if len(supervisor.groups) != 1:
            raise ReshardError(400, f"name the group to reshard: one of {', '.join(supervisor.groups)}")
        return next(iter(supervisor.groups.values()))
    if name not in supervisor.groups:
        raise ReshardError(404, f"no group {name!r}; groups: {', '.join(supervisor.groups)}")
    return supervisor.groups[name]
