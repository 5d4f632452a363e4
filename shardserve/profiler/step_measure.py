"""Measures one sweep point on the real engine: `num_warmup_steps` untimed steps, `num_repeats`
timed ones (the median step is the point's time), then one step under torch.profiler whose
split into op classes is rescaled, phase by phase, onto the median unprofiled step.

Rescaling per phase keeps the profiler's own overhead (a few microseconds per recorded op) out of
the totals: the forward's split comes from the trace, its length from the unprofiled timer, so
the classes sum to the unprofiled step time exactly. Classes inside a phase are still weighted
as the profiled step saw them, so ops with many small calls (elementwise, host glue) read a
little high.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

from shardserve.profiler.controlled_steps import ControlledBatches
from shardserve.profiler.op_classes import OP_CLASSES, ClassSplit, module_scopes, split_step
from shardserve.profiler.step_probe import PHASES, StepProbe, StepTiming
from shardserve.profiler.sweep import SweepConfig, SweepPoint


@dataclass
class PointMeasurement:
    """A sweep point's measured step: the median unprofiled step (`timing`), the spread of the
    timed totals, the profiled split, and that split rescaled onto `timing` (`class_s`,
    `comm_s`: seconds per op class and per collective, summing to timing.total_s)."""

    point: SweepPoint
    timing: StepTiming
    totals_s: tuple[float, ...]
    profiled: ClassSplit
    profiled_total_s: float
    class_s: dict[str, float]
    comm_s: dict[str, float]

    @property
    def num_seqs(self) -> int:
        return len(self.timing.batch)

    @property
    def num_tokens(self) -> int:
        return sum(t for t, _ in self.timing.batch)

    @property
    def mean_context_len(self) -> float:
        return sum(c for _, c in self.timing.batch) / max(1, len(self.timing.batch))


def rescale(split: ClassSplit, timing: StepTiming) -> tuple[dict[str, float], dict[str, float]]:
    """Per-class and per-collective seconds of `split`, each phase stretched to its length in
    `timing`. A phase the trace did not see (it took no time there) counts as host time."""
    class_s = dict.fromkeys(OP_CLASSES, 0.0)
    for phase in PHASES:
        profiled_s, measured_s = split.phase_total_s(phase), timing.phase_s.get(phase, 0.0)
        if profiled_s <= 0:
            class_s["host"] += measured_s
            continue
        scale = measured_s / profiled_s
        for cls in OP_CLASSES:
            class_s[cls] += split.seconds[phase][cls] * scale
    # collectives are not split by phase; share the rescaled comm time out in proportion
    total_comm = sum(split.comm_by_collective.values())
    if total_comm <= 0:
        return class_s, {}
    return class_s, {name: class_s["comm"] * s / total_comm for name, s in split.comm_by_collective.items()}


def measure_point(probe: StepProbe, batches: ControlledBatches, point: SweepPoint,
                  sweep: SweepConfig) -> PointMeasurement:
    """Run `point` (see the module docstring); leaves the engine with no requests."""
    decodes: list[str] = []
    if point.kind in ("decode", "mixed"):
        decodes = batches.start_decodes(point.num_seqs, point.context_len)
    try:
        def one_step() -> StepTiming:
            if point.kind == "decode":
                return probe.step()
            prompts = batches.add_prompts(point.num_seqs if point.kind == "prefill" else 1, point.prompt_len)
            try:
                return probe.step()
            finally:
                batches.abort(prompts)

        for _ in range(sweep.num_warmup_steps):
            one_step()
        timings = sorted((one_step() for _ in range(sweep.num_repeats)), key=lambda t: t.total_s)
        median = timings[len(timings) // 2]
        profiled_timing, split = _profiled_step(probe, one_step)
    finally:
        batches.abort(decodes)
    class_s, comm_s = rescale(split, median)
    return PointMeasurement(point, median, tuple(t.total_s for t in timings), split, profiled_timing.total_s,
                            class_s, comm_s)


def _profiled_step(probe: StepProbe, one_step) -> tuple[StepTiming, ClassSplit]:
    # torch 2.13's kineto writes "USDT: ... profiler_start/stop" lines to stderr on every
    # profiled step unless told to log errors only; a user's own setting wins
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof, module_scopes(probe.runner.model):
        probe.labels = True
        try:
            timing = one_step()
        finally:
            probe.labels = False
    return timing, split_step(prof.events())
