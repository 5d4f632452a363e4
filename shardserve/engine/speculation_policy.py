"""How many proposed tokens a step verifies: as many as make the step produce tokens fastest,
judged from what this engine measured, so speculation never makes a busy server slower.

Verifying k proposals of a request costs k more tokens in the step and yields, on average,
P_1 + ... + P_k more output tokens, where P_j is the chance that the first j proposals all hold:
the share of recent verifications of j or more proposals whose first j held (vLLM's acceptance
rate per position). For a step of B decoding requests, with request i holding L_i proposals:

    tokens(k) = B + sum_i  sum_{j <= min(k, L_i)} P_j
    time(k)   = a + b * (B + sum_i min(k, L_i))        (the step time, fitted on decode steps)
    choose the k in 0..K with the most tokens(k) / time(k); 0 unless it beats k = 0 by `margin`

At batch 1 a step reads every weight once whatever its few rows, b is small, and any acceptance
pays; at batch 32 on two CPU cores a row costs as much as a whole small step did, and
speculation has to be accepted nearly always to pay. `a` and `b` are a least-squares line through
the durations of recent steps that held only decodes and verifications (a prefill token costs
less than a sampled one) and whose size lies near this step's, B/2 .. (1 + K) B: the cost of a
row is not the same at batch 1 as at batch 32, so a line is only trusted where it was measured.
When those steps all had one size there is no line: the policy then verifies one proposal per
request to measure one (a probe), and waits twice as long before the next probe each time the
line says no, up to `max_probe_interval` steps, so a server that should not speculate almost
never does. P_j starts at 2^-j and follows the recent verifications (counts decayed by `decay`
a step).

Pure Python with an injected step log: tests drive it with made-up durations.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """time(T) = fixed_s + per_token_s * T for a step of T tokens."""

    fixed_s: float
    per_token_s: float

    def time(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


class SpeculationPolicy:
    def __init__(self, max_drafts: int, window: int = 256, probe_interval: int = 32,
                 max_probe_interval: int = 2048, margin: float = 0.02, decay: float = 0.98):
        self.max_drafts = max_drafts
        self.min_probe_interval = self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.margin = margin
        self.decay = decay
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) of decode steps
        self._steps_since_probe = probe_interval  # the first step with proposals may probe
        self._probed = False  # a probe ran and no decision has used its line yet
        self._last_was_probe = False
        self._drafted = [0.0] * max_drafts  # decayed counts, per position: verifications that reached it
        self._accepted = [0.0] * max_drafts  # ... and in which it held (with all before it)

    # --- what happened ---------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, decode_only: bool, duration_s: float) -> None:
        """An engine step's size and wall time; only steps of decodes and verifications count."""
        self._steps_since_probe += 1
        if decode_only and num_tokens > 0:
            self._steps.append((num_tokens, duration_s))

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafted` proposals held."""
        for j in range(num_drafted):
            self._drafted[j] += 1
            self._accepted[j] += j < num_accepted

    def end_step(self) -> None:
        """Age the acceptance counts once per step, so the rates follow the recent traffic."""
        self._drafted = [d * self.decay for d in self._drafted]
        self._accepted = [a * self.decay for a in self._accepted]

    # --- the decision ------------------------------------------------------------------------------
    def acceptance_rates(self) -> list[float]:
        """P_1 .. P_K: the chance that the first j proposals all hold, from recent verifications
        (one pseudo-count of the prior 2^-j each; never rising with j)."""
        rates, bound = [], 1.0
        for j, (a, d) in enumerate(zip(self._accepted, self._drafted)):
            bound = min(bound, (a + 0.5 ** (j + 1)) / (d + 1))
            rates.append(bound)
        return rates

    def step_cost(self, low: int = 0, high: int | None = None) -> StepCost | None:
        """The line through recent decode steps of `low` .. `high` tokens; None while those all
        had one size."""
        points = [(t, s) for t, s in self._steps if low <= t and (high is None or t <= high)]
        if len(points) < 2:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        var = sum((t - mean_t) ** 2 for t, _ in points)
        if var == 0:
            return None
        slope = sum((t - mean_t) * (s - mean_s) for t, s in points) / var
        slope = max(slope, 0.0)  # noise can tilt a flat line down; a row never saves time
        return StepCost(max(mean_s - slope * mean_t, 1e-9), slope)

    @property
    def probing(self) -> bool:
        """Whether the last answer was a probe (one proposal tried while no cost line is known)."""
        return self._last_was_probe

    def num_drafts(self, proposal_lengths: list[int]) -> int:
        """How many proposals each decoding request verifies this step (0: none); one entry per
        decoding request, its number of proposals (0 for a request that has none)."""
        self._last_was_probe = False
        if not any(proposal_lengths):
            return 0
        batch = len(proposal_lengths)
        cost = self.step_cost(batch // 2, (1 + self.max_drafts) * batch)
        if cost is None:
            if self._steps_since_probe < self.probe_interval:
                return 0
            self._steps_since_probe, self._probed, self._last_was_probe = 0, True, True
            return 1
        reach = self.acceptance_rates()
        best_k, best_rate = 0, batch / cost.time(batch) * (1 + self.margin)
        for k in range(1, self.max_drafts + 1):
            tokens = batch + sum(sum(reach[:min(k, n)]) for n in proposal_lengths)
            rate = tokens / cost.time(batch + sum(min(k, n) for n in proposal_lengths))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k:  # a line that says yes resets the wait; a probe's line that says no doubles it
            self.probe_interval = self.min_probe_interval
        elif self._probed:
            self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        self._probed = False
        return best_k
