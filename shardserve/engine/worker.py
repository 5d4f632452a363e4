"""One rank's part of an engine step in a parallel replica.

Every rank receives the same SchedulerOutput from the driver (rank 0), so every rank's
ModelRunner keeps the same request state and builds the same packed inputs. The step's sequences
are cut into micro-batches that flow through the pipeline stages:

    stage 0:  [mb0][mb1][mb2]                      each arrow: a send of the residual
    stage 1:       [mb0][mb1][mb2]                 stream [T_mb, hidden] to the rank with the
                   ^ waits (bubble)                same position in the next stage

The last stage's first rank samples; the sampled tokens reach every rank by one broadcast, and
each rank appends them to its copy of the requests' tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from shardserve.engine.interface import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from shardserve.engine.model_runner import ModelRunner
from shardserve.models.moe import expert_load, rebalance_experts
from shardserve.parallel.comm import broadcast_object, gather_objects, isend, recv
from shardserve.parallel.groups import ParallelGroups


@dataclass
class StepStats:
    """Where one rank's step time went, summed over steps:
    compute_s  running its layers (and the head), communication excluded;
    comm_s     inside tensor/expert-parallel collectives (all-reduce, all-gather, all-to-all);
    wait_s     the rest: waiting for other pipeline stages and for the step's sampled tokens
               (the pipeline bubble, plus a broadcast's own cost)."""

    rank: int = 0
    num_steps: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def wait_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.comm_s)

    @property
    def bubble_fraction(self) -> float:
        return self.wait_s / self.step_s if self.step_s else 0.0


class Worker:
    """One rank of a parallel replica: runs the runner's step as this rank's pipeline stage
    (the `Stage` that ModelRunner.execute talks to), and answers the driver's collections."""

    def __init__(self, runner: ModelRunner, groups: ParallelGroups):
        self.runner = runner
        self.groups = groups
        self.hidden_size = runner.model_config.hidden_size
        self.num_micro_batches = groups.config.num_micro_batches or groups.pp_size
        self.stats = StepStats(groups.rank)
        self.is_last = groups.is_last_stage
        self.samples = groups.rank == groups.sampler_rank
        self._sends: list = []
        self._compute_s = 0.0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start, comm_start = time.perf_counter(), self.groups.stats.seconds
        self._compute_s = 0.0
        out = self.runner.execute(sched, self)
        if not sched.is_empty:
            self.stats.num_steps += 1
            self.stats.step_s += time.perf_counter() - start
            self.stats.compute_s += self._compute_s
            self.stats.comm_s += self.groups.stats.seconds - comm_start
        return out

    # --- the Stage protocol (engine/model_runner.py) ---------------------------------------------
    def micro_batches(self, seqs: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        return split_micro_batches(seqs, self.num_micro_batches if self.groups.pp_size > 1 else 1)

    def receive(self, num_tokens: int) -> torch.Tensor | None:
        """The previous stage's residual stream [T_mb, hidden] (None on the first stage)."""
        if self.groups.is_first_stage:
            return None
        hidden_in = torch.empty(num_tokens, self.hidden_size, dtype=self.runner.kv_cache.dtype,
                                device=self.runner.device)
        return recv(hidden_in, src=self.groups.prev_stage_rank)

    def compute(self, run: Callable[[], dict[str, list[SampledToken]]]) -> dict[str, list[SampledToken]]:
        """Run one micro-batch's layers (and head); its time, communication excluded, is compute."""
        start, comm_before = time.perf_counter(), self.groups.stats.seconds
        sampled = run()
        self._compute_s += time.perf_counter() - start - (self.groups.stats.seconds - comm_before)
        return sampled

    def send(self, hidden: torch.Tensor) -> None:
        # the tensor stays referenced until its send completes
        self._sends.append((isend(hidden, dst=self.groups.next_stage_rank), hidden))

    def finish(self, sampled: dict[str, list[SampledToken]]) -> dict[str, list[SampledToken]]:
        """Wait for this step's sends; the sampled tokens, from the sampling rank to every rank."""
        for send, _ in self._sends:
            send.wait()
        self._sends = []
        return broadcast_object(sampled if self.samples else None, src=self.groups.sampler_rank,
                                group=self.groups.control)

    # --- the driver's collections ----------------------------------------------------------------
    def expert_load(self) -> list[dict] | None:
        """Every rank's `moe.expert_load`, gathered on the driver (None elsewhere)."""
        return gather_objects(expert_load(self.runner.model), dst=0, group=self.groups.control)

    def step_stats(self, reset: bool) -> list[StepStats] | None:
        """Every rank's StepStats, gathered on the driver (None elsewhere); `reset` restarts them."""
        reports = gather_objects(self.stats, dst=0, group=self.groups.control)
        if reset:
            self.stats = StepStats(self.groups.rank)
        return reports

    def rebalance_experts(self) -> None:
        rebalance_experts(self.runner.model)


def split_micro_batches(seqs: list[ScheduledSeq], num_micro_batches: int) -> list[list[ScheduledSeq]]:
    """Cut the step's sequences, in order, into up to `num_micro_batches` runs of about equal
    token counts (each non-empty). Every rank computes the same cut from the same plan."""
    total = sum(s.num_tokens for s in seqs)
    parts: list[list[ScheduledSeq]] = [[]]
    done = 0
    for seq in seqs:
        boundary = total * len(parts) / num_micro_batches
        if parts[-1] and done >= boundary and len(parts) < num_micro_batches:
            parts.append([])
        parts[-1].append(seq)
        done += seq.num_tokens
    return parts
