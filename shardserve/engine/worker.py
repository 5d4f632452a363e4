"""One rank's part of an engine step in a parallel replica.

Every rank receives the same SchedulerOutput from the driver (rank 0), so every rank's
ModelRunner keeps the same request state and builds the same packed inputs. The step's sequences
are cut into micro-batches that flow through the pipeline stages:

    stage 0:  [mb0][mb1][mb2]                      each arrow: dist.send of the residual
    stage 1:       [mb0][mb1][mb2]                 stream [T_mb, hidden] to the rank with the
                   ^ waits (bubble)                same position in the next stage

The last stage's first rank samples; the sampled tokens reach every rank by one broadcast, and
each rank appends them to its copy of the requests' tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardserve.engine.interface import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from shardserve.engine.model_runner import ModelRunner
from shardserve.models.moe import expert_load, rebalance_experts
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
    def __init__(self, runner: ModelRunner, groups: ParallelGroups):
        self.runner = runner
        self.groups = groups
        self.hidden_size = runner.model_config.hidden_size
        self.num_micro_batches = groups.config.num_micro_batches or groups.pp_size
        self.stats = StepStats(groups.rank)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        runner, groups = self.runner, self.groups
        runner.update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        start, comm_start, compute_s = time.perf_counter(), groups.stats.seconds, 0.0
        sampled: dict[str, SampledToken] = {}
        sends = []
        for seqs in split_micro_batches(sched.seqs, self.num_micro_batches if groups.pp_size > 1 else 1):
            inputs = runner.prepare_inputs(seqs)
            hidden_in = None
            if not groups.is_first_stage:
                hidden_in = torch.empty(len(inputs.input_ids), self.hidden_size, dtype=runner.kv_cache.dtype,
                                        device=runner.device)
                dist.recv(hidden_in, src=groups.prev_stage_rank)
            compute_start, comm_before = time.perf_counter(), groups.stats.seconds
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta, hidden_in)
            if not groups.is_last_stage:  # the tensor stays referenced until its send completes
                sends.append((dist.isend(hidden, dst=groups.next_stage_rank), hidden))
            elif inputs.sample_req_ids:
                if groups.rank == groups.sampler_rank:
                    sampled.update(runner.sample(inputs, hidden))
                else:  # the vocab-parallel head is a collective: every last-stage rank takes part
                    runner.model.compute_logits(hidden[inputs.sample_indices])
            compute_s += time.perf_counter() - compute_start - (groups.stats.seconds - comm_before)
        for send, _ in sends:
            send.wait()
        sampled = self._share_sampled(sampled)
        runner.record(sampled)
        self.stats.num_steps += 1
        self.stats.step_s += time.perf_counter() - start
        self.stats.compute_s += compute_s
        self.stats.comm_s += groups.stats.seconds - comm_start
        return ModelRunnerOutput(sampled)

    def expert_load(self) -> list[dict] | None:
        """Every rank's `moe.expert_load`, gathered on the driver (None elsewhere)."""
        mine = expert_load(self.runner.model)
        reports = [None] * self.groups.world_size if self.groups.is_driver else None
        dist.gather_object(mine, reports, dst=0, group=self.groups.control)
        return reports

    def step_stats(self, reset: bool) -> list[StepStats] | None:
        """Every rank's StepStats, gathered on the driver (None elsewhere); `reset` restarts them."""
        reports = [None] * self.groups.world_size if self.groups.is_driver else None
        dist.gather_object(self.stats, reports, dst=0, group=self.groups.control)
        if reset:
            self.stats = StepStats(self.groups.rank)
        return reports

    def rebalance_experts(self) -> None:
        rebalance_experts(self.runner.model)

    def _share_sampled(self, sampled: dict[str, SampledToken]) -> dict[str, SampledToken]:
        box = [sampled if self.groups.rank == self.groups.sampler_rank else None]
        dist.broadcast_object_list(box, src=self.groups.sampler_rank, group=self.groups.control)
        return box[0]


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
