"""ThreadGovernor: how many CPU threads the next engine step runs with, chosen by measuring.

A step runs hundreds of small parallel regions, and each waits for its slowest thread. On a quiet
2-core host a batch-32 float32 decode step took 185 ms with 2 threads and 287 ms with 1; with
another process busy on one core it took 626 ms with 2 and 354 ms with 1 (2026-12-02): the thread
sharing its core waits for a time slice, milliseconds, at every barrier. No fixed count is right
on both days, and the host changes under a running server, so the engine measures. A probe runs
`probe_steps` steps with each candidate count, interleaved so that the candidates see the same
batches, and keeps the fastest unless it wins by less than `min_gain`.

A probe costs its steps at the slower counts: on a quiet 2-core host three 1-thread steps every
100 cost 4-5% of offline throughput (64 requests of 128 + 128 tokens, SmolLM2 bf16: fixed 2
threads ran 6% faster than probing every 100 steps, 4 of 5 alternating pairs, 2026-12-04). So
the wait between probes doubles each time a probe keeps the count (`probe_every` up to
`max_probe_every` steps), and comes back to `probe_every` after a switch, or as soon as the
steps at the current count cost `rise_to_probe` more per token than at the last probe -- the
sign that the host changed -- though never sooner than `probe_every` steps after the last one.

The count never changes a result: every kernel splits its work over independent rows, heads or
output columns (tests/engine/test_thread_governor.py compares logits bitwise).
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ThreadPolicy:
    max_threads: int
    adaptive: bool = True  # False: always max_threads
    probe_every: int = 100  # steps between probes, at least
    max_probe_every: int = 1600  # ... and at most, once probes keep finding the same count
    rise_to_probe: float = 0.25  # a cost rise per token that brings the next probe forward
    first_probe_after: int = 8  # steps before the first probe (the kernels have warmed up)
    probe_steps: int = 3  # steps per candidate in one probe
    min_gain: float = 0.1  # switch only to a count at least this much faster
    overhead_tokens: int = 16  # a step's fixed cost, in tokens, when normalizing step times


_RECENT_STEPS = 5  # steps whose median cost is compared with the last probe's


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
        self._interval = policy.probe_every  # the wait after the last probe
        self._probe: list[int] = []  # the counts of the probe's remaining steps
        self._costs: dict[int, list[float]] = {}
        self._baseline: float | None = None  # the current count's cost per token at the last probe
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)  # its costs since
        self._since_probe = 0
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
        cost = elapsed_s / (num_tokens + self.policy.overhead_tokens) if num_tokens > 0 else None
        if not self._costs:  # a step outside probes
            self._watch(cost)
            return
        if cost is not None:
            self._costs[self._step_threads].append(cost)
        if not self._probe:
            self._decide()

    def _watch(self, cost: float | None) -> None:
        """Bring the next probe forward when the current count's steps have grown costlier."""
        self._since_probe += 1
        if cost is None or self._baseline is None:
            return
        self._recent.append(cost)
        if (self._since_probe >= self.policy.probe_every and len(self._recent) == self._recent.maxlen
                and statistics.median(self._recent) > (1 + self.policy.rise_to_probe) * self._baseline):
            self._steps_to_probe = 0

    def _decide(self) -> None:
        costs = {n: statistics.median(c) for n, c in self._costs.items() if c}
        self._costs = {}
        self.num_probes += 1
        self._since_probe = 0
        self._recent.clear()
        if self.current not in costs:  # an idle probe: nothing measured
            self._steps_to_probe = self._interval
            return
        best = min(costs, key=costs.get)
        if costs[best] < (1 - self.policy.min_gain) * costs[self.current]:
            self.current = best
            self.num_switches += 1
            self._interval = self.policy.probe_every
        else:
            self._interval = min(2 * self._interval, self.policy.max_probe_every)
        self._steps_to_probe = self._interval
        self._baseline = costs[self.current]
