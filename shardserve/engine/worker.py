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
class PipelineStats:
    """Seconds this rank spent computing and waiting for the previous stage, summed over steps."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    num_steps: int = 0

    @property
    def bubble_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0


class Worker:
    def __init__(self, runner: ModelRunner, groups: ParallelGroups):
        self.runner = runner
        self.groups = groups
        self.hidden_size = runner.model_config.hidden_size
        self.num_micro_batches = groups.config.num_micro_batches or groups.pp_size
        self.pipeline = PipelineStats()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        runner, groups = self.runner, self.groups
        runner.update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        start = time.perf_counter()
        idle_s = 0.0
        sampled: dict[str, SampledToken] = {}
        sends = []
        for seqs in split_micro_batches(sched.seqs, self.num_micro_batches if groups.pp_size > 1 else 1):
            inputs = runner.prepare_inputs(seqs)
            hidden_in = None
            if not groups.is_first_stage:
                hidden_in = torch.empty(len(inputs.input_ids), self.hidden_size, dtype=runner.kv_cache.dtype,
                                        device=runner.device)
                wait_start = time.perf_counter()
                dist.recv(hidden_in, src=groups.prev_stage_rank)
                idle_s += time.perf_counter() - wait_start
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.meta, hidden_in)
            if not groups.is_last_stage:
                sends.append(dist.isend(hidden, dst=groups.next_stage_rank))
            elif inputs.sample_req_ids:
                if groups.rank == groups.sampler_rank:
                    sampled.update(runner.sample(inputs, hidden))
                else:  # the vocab-parallel head is a collective: every last-stage rank takes part
                    runner.model.compute_logits(hidden[inputs.sample_indices])
        for send in sends:
            send.wait()
        sampled = self._share_sampled(sampled)
        runner.record(sampled)
        self.pipeline.busy_s += time.perf_counter() - start - idle_s
        self.pipeline.idle_s += idle_s
        self.pipeline.num_steps += 1
        return ModelRunnerOutput(sampled)

    def expert_load(self) -> list[dict] | None:
        """Every rank's `moe.expert_load`, gathered on the driver (None elsewhere)."""
        mine = expert_load(self.runner.model)
        reports = [None] * self.groups.world_size if self.groups.is_driver else None
        dist.gather_object(mine, reports, dst=0, group=self.groups.control)
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
