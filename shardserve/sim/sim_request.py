"""A simulated request: the engine's own `Request`, plus where its tokens came out.

A request's tokens leave the engine at the ends of the steps that sampled them. Rather than a time
per token, a request keeps the *step numbers* of its replica at which it got one, as runs of
consecutive steps (`emitted runs`): a request that decodes every step from its first token to its
last, as almost all do, is one run (first_step, last_step); a preemption or a skipped step starts
another. The replica's step end times turn runs into token times when the simulation is over.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.request import Request


@dataclass(eq=False, slots=True)
class SimRequest(Request):
    """`Request` with the simulator's bookkeeping. `decode_delta` and `finish_step` are valid while
    the request sits in its replica's DecodeGroup (see decode_group.py)."""

    index: int = -1  # position in the workload
    start_s: float = 0.0  # when the client sent it
    scheduled_s: float = 0.0  # when the workload wanted it sent

    run_first_step: int = -1  # the current run of consecutive emitting steps
    run_last_step: int = -1
    earlier_runs: list | None = None  # closed runs [(first_step, last_step)], oldest first (rare)
    decode_delta: int = 0  # in the decode group: position computed at step s is s + decode_delta
    finish_step: int = 0  # in the decode group: the step whose update finishes it
    group_first_step: int = 0  # in the decode group: its first step there

    def emitted_at(self, step: int) -> None:
        """A token came out at the end of `step` (steps of this replica only grow)."""
        self.emitted_during(step, step)

    def emitted_during(self, first_step: int, last_step: int) -> None:
        """A token came out at the end of every step from `first_step` to `last_step`."""
        if last_step < first_step:
            return
        if self.run_first_step >= 0 and self.run_last_step == first_step - 1:
            self.run_last_step = last_step
            return
        if self.run_first_step >= 0:
            if self.earlier_runs is None:
                self.earlier_runs = []
            self.earlier_runs.append((self.run_first_step, self.run_last_step))
        self.run_first_step, self.run_last_step = first_step, last_step

    def runs(self) -> list[tuple[int, int]]:
        """Every run of emitting steps, oldest first."""
        return [*(self.earlier_runs or ()), (self.run_first_step, self.run_last_step)]
