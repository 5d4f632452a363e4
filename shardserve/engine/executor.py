"""How the engine's steps get run: one protocol, a local and a parallel implementation. The
launcher (engine/launcher.py) picks one where the process learns which rank it is; the engine
calls the protocol and never asks which it has.

The parallel executor is the driver's side of a replica split over several processes:

    driver (rank 0)                                   workers (ranks 1..N-1): run_worker_loop
    engine.step() -> executor.execute(sched)
        broadcast_object_list([sched]) ------------->  receive sched
        worker.execute(sched)  <---- hidden states, all-reduces, sampled tokens ---->  worker.execute(sched)

Messages go over the gloo control group (parallel/comm.py); there is no other channel. A
rank that dies breaks the next collective (gloo sees the closed connection), one that hangs
makes it time out after `comm_timeout_s`: either way every survivor raises and exits, and the
driver fails its in-flight requests. An idle driver sends a Heartbeat every `heartbeat_s` so
that the workers' wait for the next message never reaches the timeout.

After a driver operation failed part-way the executor is `failed`: survivors may sit in that
operation's point-to-point receives (which no later message reaches) until `comm_timeout_s`, so
no Shutdown is sent and the spawned ranks are killed instead of awaited.
"""
from __future__ import annotations

import atexit
import gc
import logging
import time
from contextlib import contextmanager
from typing import Protocol


from shardserve.engine.interface import (
    CollectExpertLoad, CollectStepStats, Heartbeat, ModelRunnerOutput, RebalanceExperts, SchedulerOutput, Shutdown,
)
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.worker import StepStats, Worker
from shardserve.models.moe import expert_load, rebalance_experts
from shardserve.parallel.comm import broadcast_object
from shardserve.parallel.expert import ExpertLoadReport
from shardserve.parallel.launch import Ranks

log = logging.getLogger(__name__)


class Executor(Protocol):
    runner: ModelRunner  # this process's runner (the driver's, in a parallel replica)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every rank; the sampled tokens."""

    def step_stats(self, reset: bool = True) -> list[StepStats]:
        """Per rank: step time split into compute, communication and pipeline waiting, summed
        since the last reset ([] in a single process)."""

    def expert_load(self) -> ExpertLoadReport:
        """Expert load per MoE layer since the last rebalance, over all ranks (empty when dense)."""

    def rebalance_experts(self) -> None:
        """Re-place experts from the load observed so far (outputs do not change)."""

    def keep_alive(self) -> None:
        """Call when idle: lets the other ranks know the driver lives."""

    def shutdown(self) -> None:
        """Stop the other ranks (nothing to do in a single process)."""


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def step_stats(self, reset: bool = True) -> list[StepStats]:
        return []

    def expert_load(self) -> ExpertLoadReport:
        return ExpertLoadReport.from_ranks([expert_load(self.runner.model)])

    def rebalance_experts(self) -> None:
        rebalance_experts(self.runner.model)

    def keep_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ParallelExecutor:
    """Rank 0 of a replica: every call is sent to the workers, then done here as they do it."""

    def __init__(self, worker: Worker, ranks: Ranks, heartbeat_s: float = 2.0):
        self.worker = worker
        self.runner = worker.runner
        self.ranks: Ranks | None = ranks
        self.heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self._closed = False
        self.failed = False
        atexit.register(self.shutdown)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._everywhere(sched, lambda: self.worker.execute(sched))

    def step_stats(self, reset: bool = True) -> list[StepStats]:
        return self._everywhere(CollectStepStats(reset), lambda: self.worker.step_stats(reset))

    def expert_load(self) -> ExpertLoadReport:
        return ExpertLoadReport.from_ranks(self._everywhere(CollectExpertLoad(), self.worker.expert_load))

    def rebalance_experts(self) -> None:
        self._everywhere(RebalanceExperts(), self.worker.rebalance_experts)

    def keep_alive(self) -> None:
        """Sends a Heartbeat if nothing went out for `heartbeat_s`."""
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            with self._failing_on_error():
                self._send(Heartbeat())

    def shutdown(self) -> None:
        """Tell the workers to exit and wait for the ranks this process spawned. After a failed
        operation nothing is sent and they are killed at once rather than awaited: a survivor can
        be stuck in that operation's collectives until `comm_timeout_s`."""
        if not self._closed and not self.failed:
            self._closed = True
            try:
                with self._failing_on_error():
                    self._send(Shutdown())
            except Exception:  # a peer is already gone: the ranks are killed below
                pass
        if self.ranks is not None:
            self.ranks.close(timeout_s=0.0 if self.failed else 30.0)
            self.ranks = None

    def _everywhere(self, message, action):
        """Send `message` to the workers, then do this rank's part (`action`), as they do theirs."""
        with self._failing_on_error():
            self._send(message)
            return action()

    @contextmanager
    def _failing_on_error(self):
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def _send(self, message) -> None:
        broadcast_object(message, src=0, group=self.worker.groups.control)
        self._last_sent = time.monotonic()


def run_worker_loop(worker: Worker) -> None:
    """A non-driver rank: execute every step the driver sends until Shutdown. Raises (and the
    caller exits non-zero) when the driver or a peer is lost."""
    gc.freeze()  # the loaded model's objects are permanent: no full collection walks them (serve.py)
    handlers = {
        SchedulerOutput: worker.execute,
        CollectExpertLoad: lambda _: worker.expert_load(),
        CollectStepStats: lambda message: worker.step_stats(message.reset),
        RebalanceExperts: lambda _: worker.rebalance_experts(),
        Heartbeat: lambda _: None,
    }
    while True:
        message = broadcast_object(None, src=0, group=worker.groups.control)
        if isinstance(message, Shutdown):
            return
        handlers[type(message)](message)
