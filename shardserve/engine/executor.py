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

After a driver operation failed part-way the executor is `failed`: survivors may sit in that
operation's point-to-point receives (which no later message reaches) until `comm_timeout_s`, so
no Shutdown is sent and the caller kills the ranks it spawned instead of waiting for them.
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager

import torch.distributed as dist

from shardserve.engine.interface import (
    CollectExpertLoad, CollectStepStats, Heartbeat, ModelRunnerOutput, RebalanceExperts, SchedulerOutput, Shutdown,
)
from shardserve.engine.worker import Worker

log = logging.getLogger(__name__)


class ParallelExecutor:
    def __init__(self, worker: Worker, heartbeat_s: float = 2.0):
        self.worker = worker
        self.groups = worker.groups
        self.heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self._closed = False
        self.failed = False

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._everywhere(sched, lambda: self.worker.execute(sched))

    def expert_load(self) -> list[dict]:
        return self._everywhere(CollectExpertLoad(), self.worker.expert_load)

    def step_stats(self, reset: bool = True) -> list:
        return self._everywhere(CollectStepStats(reset), lambda: self.worker.step_stats(reset))

    def rebalance_experts(self) -> None:
        self._everywhere(RebalanceExperts(), self.worker.rebalance_experts)

    def _everywhere(self, message, action):
        """Send `message` to the workers, then do this rank's part (`action`), as they do theirs."""
        with self._failing_on_error():
            self._send(message)
            return action()

    def keep_alive(self) -> None:
        """Call while idle: sends a Heartbeat if nothing went out for `heartbeat_s`."""
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            with self._failing_on_error():
                self._send(Heartbeat())

    def shutdown(self) -> bool:
        """Tell the workers to exit; True if they were told (now or before). A failed executor
        sends nothing and returns False: the caller must not wait for the workers."""
        if not self._closed and not self.failed:
            self._closed = True
            with self._failing_on_error():
                self._send(Shutdown())
        return not self.failed

    @contextmanager
    def _failing_on_error(self):
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def _send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.groups.control)
        self._last_sent = time.monotonic()


def run_worker_loop(worker: Worker) -> None:
    """A non-driver rank: execute every step the driver sends until Shutdown. Raises (and the
    caller exits non-zero) when the driver or a peer is lost."""
    gc.freeze()  # the loaded model's objects are permanent: no full collection walks them (serve.py)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=worker.groups.control)
        message = box[0]
        if isinstance(message, Shutdown):
            return
        if isinstance(message, SchedulerOutput):
            worker.execute(message)
        elif isinstance(message, CollectExpertLoad):
            worker.expert_load()
        elif isinstance(message, CollectStepStats):
            worker.step_stats(message.reset)
        elif isinstance(message, RebalanceExperts):
            worker.rebalance_experts()
