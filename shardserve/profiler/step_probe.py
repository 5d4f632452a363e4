"""Times the phases of `engine.step()` on the real engine:

    engine.step()
      scheduler.schedule()        schedule   host
      runner.execute(sched)
        runner.prepare_inputs()   prepare    host: packing token ids, positions, block tables
        model forward             forward    GEMMs, attention, elementwise, communication
        runner.sample()           sample     LM head GEMM and the sampler
      scheduler.update()          update     host
      (the rest)                  other      host: detokenization, outputs, the parallel
                                             executor's step broadcast and token sharing

The probe wraps those calls on this engine's instances (the scheduler, this process's model
runner, hooks on the model) and undoes it on exit; nothing changes for other engines, and an
engine outside the probe runs untouched. In a parallel replica it times the driver's (rank 0's)
part. With `labels` set, each phase is also a torch.profiler range (see op_classes.py), so a
profiled step can be split by phase; unprofiled steps pay only a few perf_counter calls.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch.autograd.profiler import record_function

from shardserve.engine.engine import LLMEngine

PHASES = ("schedule", "prepare", "forward", "sample", "update", "other")
PHASE_LABEL = "shardserve/phase/"
STEP_LABEL = "shardserve/step"


@dataclass
class StepTiming:
    """One measured step: wall time per phase ("other" = the step's rest), and the batch it ran
    as (new tokens, context length) per sequence, in scheduling order."""

    total_s: float
    phase_s: dict[str, float]
    batch: tuple[tuple[int, int], ...] = field(default_factory=tuple)


class StepProbe:
    """Context manager; `step()` runs and times one engine step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.runner = engine.runner  # this process's: the driver rank's in a parallel replica
        self.labels = False
        self._phase_s: dict[str, float] = {}
        self._undo: list = []

    def __enter__(self) -> "StepProbe":
        scheduler = self.engine.scheduler
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(scheduler, "update", "update")
        self._wrap(self.runner, "prepare_inputs", "prepare")
        self._wrap(self.runner, "sample", "sample")
        model = self.runner.model
        handles = (model.register_forward_pre_hook(self._forward_start),
                   model.register_forward_hook(self._forward_end))
        self._undo.extend(h.remove for h in handles)
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def step(self) -> StepTiming:
        """Run `engine.step()` once and return its timing."""
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        start = time.perf_counter()
        with self._label(STEP_LABEL):
            self.engine.step()
        total_s = time.perf_counter() - start
        self._phase_s["other"] = max(0.0, total_s - sum(self._phase_s.values()))
        return StepTiming(total_s, dict(self._phase_s), self.engine.last_step.batch)

    @contextmanager
    def _label(self, name: str):
        if not self.labels:
            yield
            return
        with record_function(name):
            yield

    def _wrap(self, obj, attr: str, phase: str) -> None:
        had_own = attr in vars(obj)
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            with self._label(PHASE_LABEL + phase):
                result = original(*args, **kwargs)
            if phase in self._phase_s:
                self._phase_s[phase] += time.perf_counter() - start
            return result

        setattr(obj, attr, timed)
        self._undo.append(lambda: setattr(obj, attr, original) if had_own else delattr(obj, attr))

    # the forward is timed by module hooks (a pipeline stage may run it once per micro-batch)
    def _forward_start(self, module, args) -> None:
        self._forward_started = time.perf_counter()
        if self.labels:
            self._forward_range = record_function(PHASE_LABEL + "forward")
            self._forward_range.__enter__()

    def _forward_end(self, module, args, output) -> None:
        if self.labels:
            self._forward_range.__exit__(None, None, None)
        if "forward" in self._phase_s:
            self._phase_s["forward"] += time.perf_counter() - self._forward_started
