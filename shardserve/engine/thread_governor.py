"""ThreadGovernor: how many CPU threads the next engine step runs with, chosen by measuring.

A step runs hundreds of small parallel regions, and each waits for its slowest thread. On a quiet
2-core host a batch-32 float32 decode step took 185 ms with 2 threads and 287 ms with 1; with
another process busy on one core it took 626 ms with 2 and 354 ms with 1 (2026-12-02): the thread
sharing its core waits for a time slice, milliseconds, at every barrier. No fixed count is right
on both days, and the host changes under a running server, so the engine measures. Every
`probe_every` steps it runs `probe_steps` steps with each candidate count, interleaved so that
the candidates see the same batches, and keeps the fastest unless it wins by less than
`min_gain`. A probe costs a few steps at a slower count: about 1% of the steps on a quiet host.

The count never changes a result: every kernel splits its work over independent rows, heads or
output columns (tests/engine/test_thread_governor.py compares logits bitwise).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ThreadPolicy:
    max_threads: int
    adaptive: bool = True  # False: always max_threads
    probe_every: int = 100  # steps between probes
    first_probe_after: int = 8  # steps before the first probe (the kernels have warmed up)
    probe_steps: int = 3  # steps per candidate in one probe
    min_gain: float = 0.1  # switch only to a count at least this much faster
    overhead_tokens: int = 16  # a step's fixed cost, in tokens, when normalizing step times


def available_threads() -> int:
    """The threads this process may use: OMP_NUM_THREADS when set, else the CPUs it may run on
    (not torch's current count, which an earlier engine in the process may have lowered)."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return len(os.sched_getaffinity(0))


def candidate_counts(max_threads: int) -> tuple[int, ...]:
    """All the threads, half of them and one: (2, 1) on two cores, (16, 8, 1) on sixteen."""
    return tuple(sorted({max_threads, max(1, max_threads // 2), 1}, reverse=True))


class ThreadGovernor:
    """Call `before_step()` before each step and `after_step(num_tokens, elapsed_s)` after it."""

    def __init__(self, policy: ThreadPolicy, set_threads: Callable[[int], None]):
        self.policy = policy
        self._set_threads = set_threads
        self.candidates = candidate_counts(policy.max_threads) if policy.adaptive else (policy.max_threads,)
        self.current = policy.max_threads  # the count steps run with outside probes
        self._applied: int | None = None
        self._steps_to_probe = policy.first_probe_after
        self._probe: list[int] = []  # the counts of the probe's remaining steps
        self._costs: dict[int, list[float]] = {}
        self._step_threads = self.current
        self.num_probes = 0
        self.num_switches = 0

    def before_step(self) -> int:
        """Set and return the thread count for the coming step."""
        if len(self.candidates) > 1 and not self._probe:
            if self._steps_to_probe > 0:
                self._steps_to_probe -= 1
            else:
                self._probe = [n for _ in range(self.policy.probe_steps) for n in self.candidates]
                self._costs = {n: [] for n in self.candidates}
        self._step_threads = self._probe.pop(0) if self._probe else self.current
        if self._step_threads != self._applied:
            self._set_threads(self._step_threads)
            self._applied = self._step_threads
        return self._step_threads

    def after_step(self, num_tokens: int, elapsed_s: float) -> None:
        if not self._costs:
            return
        if num_tokens > 0:
            self._costs[self._step_threads].append(elapsed_s / (num_tokens + self.policy.overhead_tokens))
        if not self._probe:
            self._decide()

    def _decide(self) -> None:
        costs = {n: statistics.median(c) for n, c in self._costs.items() if c}
        self._costs = {}
        self._steps_to_probe = self.policy.probe_every
        self.num_probes += 1
        if self.current not in costs:
            return  # an idle probe: nothing measured
        best = min(costs, key=costs.get)
        if costs[best] < (1 - self.policy.min_gain) * costs[self.current]:
            self.current = best
            self.num_switches += 1
