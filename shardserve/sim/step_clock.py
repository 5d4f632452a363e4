"""How long a simulated engine step takes: the planner's cost model (`cost_model.step_time`), asked
about the batch the real Scheduler built, scaled by what serving adds to it, plus serving's cost
per sequence in the step (ServingOverheads).

A step's batch is described the way the cost model sums it: `num_decodes` one-token sequences
whose contexts add up to `decode_context_sum` (one-token prefill tails count among them, as the
cost model counts them), plus the longer prompt chunks as (num_tokens, context_len).

A simulation asks for millions of steps, and a cost-model call costs tens of microseconds, so the
two common shapes have a cached exact form, a function of the summed decode context S alone:

    decodes only            affine in S: every term is either fixed by the batch size n or
                            proportional to S (attention's FLOPs and KV reads both are)
    decodes + one chunk     convex and piecewise linear in S with at most one kink (the attention
                            roofline of the chunk's fixed work plus S's share): the larger of two lines

The form for a batch shape (n, or n and the chunk) is built from the cost model's values at the
ends of S's feasible range [n, n * max_model_len] and checked against it at interior points; where
the check fails (a cost model of another shape: pipeline stages add kinks), that shape is always
asked of the cost model directly. A mixed shape is only fitted once it has come up twice. Decode
runs and single steps use the same arithmetic, so k steps taken at once land on exactly the
times of k single steps.
"""
from __future__ import annotations

import math

from shardserve.planner.batch_load import BatchSummary
from shardserve.planner.cost_model import Deployment, step_time

_REL_TOL = 1e-9


class StepClock:
    """Step durations in seconds for one replica's deployment (see the module docstring)."""

    def __init__(self, deployment: Deployment, max_model_len: int, decode_step_scale: float = 1.0,
                 prompt_step_scale: float = 1.0, step_seq_s: float = 0.0):
        self.deployment = deployment
        self.max_model_len = max_model_len
        # serving's slowdown of decode-only steps and of steps with a prompt chunk, and its cost per
        # sequence in a step (ServingOverheads)
        self.decode_step_scale, self.prompt_step_scale = decode_step_scale, prompt_step_scale
        self.step_seq_s = step_seq_s
        self._decode: dict[int, tuple[float, float] | None] = {}  # n -> (base_s, per_token_s)
        # (n, chunk tokens, chunk context) -> times seen (int), two lines, a value (n = 0) or None (no form)
        self._mixed: dict[tuple[int, int, int], tuple[float, float, float, float] | float | int | None] = {}

    # --- the cost model ----------------------------------------------------------------------------
    def _direct_s(self, num_decodes: int, decode_context_sum: float, chunk: tuple[int, int] | None) -> float:
        mean_context = decode_context_sum / num_decodes if num_decodes else 0.0
        num_tokens, context_len = chunk or (0, 0)
        summary = BatchSummary(num_prefill_tokens=num_tokens, prefill_context_len=context_len,
                               num_decode_seqs=num_decodes, decode_context_len=mean_context)
        scale = self.prompt_step_scale if num_tokens else self.decode_step_scale
        num_seqs = num_decodes + (1 if num_tokens else 0)
        return step_time(self.deployment, summary).total_s * scale + self.step_seq_s * num_seqs

    def _lines(self, num_decodes: int, chunk: tuple[int, int] | None) -> tuple[float, float, float, float] | None:
        """(a1, b1, a2, b2) with f(S) = max(a1 + b1 S, a2 + b2 S) over S's range, checked; or None."""
        lo, hi = float(num_decodes), float(num_decodes * self.max_model_len)
        if hi <= lo:
            return None
        delta = (hi - lo) / 64

        def line(x0: float, x1: float) -> tuple[float, float]:
            f0, f1 = self._direct_s(num_decodes, x0, chunk), self._direct_s(num_decodes, x1, chunk)
            slope = (f1 - f0) / (x1 - x0)
            return f0 - slope * x0, slope

        a1, b1 = line(lo, lo + delta)
        a2, b2 = line(hi - delta, hi)
        for x in (lo + (hi - lo) * 0.37, lo + (hi - lo) * 0.5, lo + (hi - lo) * 0.63, lo + 2 * delta, hi - 2 * delta):
            if not math.isclose(max(a1 + b1 * x, a2 + b2 * x), self._direct_s(num_decodes, x, chunk), rel_tol=_REL_TOL):
                return None
        return a1, b1, a2, b2

    # --- the clock -------------------------------------------------------------------------------
    def decode_coefficients(self, num_decodes: int) -> tuple[float, float] | None:
        """(base_s, per_token_s) of a decode-only step of `num_decodes`, or None (ask decode_s)."""
        if num_decodes not in self._decode:
            lines = self._lines(num_decodes, None)
            affine = lines is not None and math.isclose(lines[1], lines[3], rel_tol=_REL_TOL)
            self._decode[num_decodes] = (lines[2], lines[3]) if affine else None
        return self._decode[num_decodes]

    def decode_s(self, num_decodes: int, decode_context_sum: int) -> float:
        """One step of `num_decodes` one-token sequences whose contexts sum to `decode_context_sum`."""
        coefficients = self.decode_coefficients(num_decodes)
        if coefficients is None:
            return self._direct_s(num_decodes, decode_context_sum, None)
        base_s, per_token_s = coefficients
        return base_s + per_token_s * decode_context_sum

    def decode_ends(self, start_s: float, num_decodes: int, decode_context_sum: int, num_steps: int) -> list[float]:
        """End times of `num_steps` decode steps from `start_s`, at `num_decodes` sequences whose
        contexts sum to `decode_context_sum` at the first and grow by one token each a step: the
        same float operations as decode_s and `start + duration`, one step at a time, so that a
        run of steps lands where single steps would (decode_s's affine form inlined: calling it
        each step took twice the time, on the simulator's decode fast path)."""
        coefficients = self.decode_coefficients(num_decodes)
        ends, end_s = [], start_s
        for _ in range(num_steps):
            if coefficients is None:
                end_s += self._direct_s(num_decodes, decode_context_sum, None)
            else:
                end_s += coefficients[0] + coefficients[1] * decode_context_sum
            ends.append(end_s)
            decode_context_sum += num_decodes
        return ends

    def mixed_s(self, num_decodes: int, decode_context_sum: int, chunk: tuple[int, int]) -> float:
        """One step of `num_decodes` one-token sequences plus one prompt chunk (num_tokens, context_len)."""
        key = (num_decodes, *chunk)
        entry = self._mixed.get(key, 0)
        if not num_decodes:  # a chunk alone: one value
            if not isinstance(entry, float):
                self._mixed[key] = entry = self._direct_s(0, 0, chunk)
            return entry
        if isinstance(entry, int):  # seen `entry` times: fit on the second
            self._mixed[key] = entry = self._lines(num_decodes, chunk) if entry >= 1 else 1
        if isinstance(entry, tuple):
            a1, b1, a2, b2 = entry
            return max(a1 + b1 * decode_context_sum, a2 + b2 * decode_context_sum)
        return self._direct_s(num_decodes, decode_context_sum, chunk)

    def step_s(self, num_decodes: int, decode_context_sum: int, chunks: list[tuple[int, int]]) -> float:
        """A step of `num_decodes` one-token sequences plus prompt `chunks` (num_tokens, context_len)."""
        if not chunks:
            return self.decode_s(num_decodes, decode_context_sum) if num_decodes else 0.0
        if len(chunks) == 1:
            return self.mixed_s(num_decodes, decode_context_sum, chunks[0])
        batch: list[tuple[float, float]] = list(chunks)
        if num_decodes:
            batch += [(1, decode_context_sum / num_decodes)] * num_decodes
        return (step_time(self.deployment, batch).total_s * self.prompt_step_scale
                + self.step_seq_s * (num_decodes + len(chunks)))
