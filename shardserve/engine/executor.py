"""The driver's side of a parallel replica: the same `execute(sched)` contract as ModelRunner,
carried out by every rank.

    driver (rank 0)                                   workers (ranks 1..N-1): run_worker_loop
    engine.step() -> executor.execute(sched)
        broadcast_object_list([sched]) ------------->  receive sched
        worker.execute(sched)  <---- hidden states, all-reduces, sampled tokens ---->  worker.execute(sched)

Messages go over the gloo control group with torch.distributed; there is no other channel. A
rank that dies breaks the next collective (gloo sees the closed connection), one that hangs
makes it time out after `comm_timeout_s`: either way every survivor raises and exits, and the
driver fails its in-flight requests. An idle driver sends a Heartbeat every `heartbeat_s` so
that the workers' wait for the next message never reaches the timeout.
"""
from __future__ import annotations

import logging
import time

import torch.distributed as dist

from shardserve.engine.interface import Heartbeat, ModelRunnerOutput, SchedulerOutput, Shutdown
from shardserve.engine.worker import Worker

log = logging.getLogger(__name__)


class ParallelExecutor:
    def __init__(self, worker: Worker, heartbeat_s: float = 2.0):
        self.worker = worker
        self.groups = worker.groups
        self.heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self._closed = False

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._send(sched)
        return self.worker.execute(sched)

    def keep_alive(self) -> None:
        """Call while idle: sends a Heartbeat if nothing went out for `heartbeat_s`."""
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            self._send(Heartbeat())

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._send(Shutdown())

    def _send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.groups.control)
        self._last_sent = time.monotonic()


def run_worker_loop(worker: Worker) -> None:
    """A non-driver rank: execute every step the driver sends until Shutdown. Raises (and the
    caller exits non-zero) when the driver or a peer is lost."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=worker.groups.control)
        message = box[0]
        if isinstance(message, Shutdown):
            return
        if isinstance(message, SchedulerOutput):
            worker.execute(message)
