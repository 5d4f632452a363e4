"""From simulated requests to the `BenchResult` that `shardserve bench` reports.

A finished request is kept as a few numbers: its replica, the steps at which it emitted (runs of
consecutive steps, sim_request.py) and its send time. When the level is over, the replicas' step
end times turn steps into token arrival times at the client:

    chunk time = (end of the emitting step + token_delay_s) - level start

Up to `records_limit` requests the result goes through bench's own `summarize_run` on
`RequestRecord`s, one chunk time per token, like a measured run. Above it (a million requests
would need a hundred million chunk times) the same numbers are computed from the steps directly:
TTFT, TPOT and E2E per request as RequestRecord computes them, and ITL as a weighted sample, each
step's gap (the same float difference of two chunk times) counted once per request that emitted
at both of its ends. tests/sim/test_sim_results.py checks that both give the same summary.
"""
from __future__ import annotations

import math
from array import array

import numpy as np

from shardserve.bench.stats import (
    PERCENTILES, SLO, BenchResult, LatencySummary, LoadLevel, RequestRecord, _error_samples, summarize_ms,
    summarize_run,
)
from shardserve.sim.sim_request import SimRequest


class LevelResults:
    """The requests of one load level as they end (any order); `summarize` at the end."""

    def __init__(self, level: LoadLevel, start_s: float, token_delay_s: float):
        self.level, self.start_s, self.token_delay_s = level, start_s, token_delay_s
        self.index, self.replica = array("q"), array("q")
        self.prompt_len, self.target_len, self.num_tokens = array("q"), array("q"), array("q")
        self.scheduled_s, self.sent_s = array("d"), array("d")
        self.first_step, self.last_step = array("q"), array("q")
        self.earlier_runs: dict[int, list[tuple[int, int]]] = {}  # row -> runs before the last
        self.failed: list[RequestRecord] = []

    def add_finished(self, req: SimRequest, replica: int) -> None:
        row = len(self.index)
        self.index.append(req.index)
        self.replica.append(replica)
        self.prompt_len.append(len(req.prompt_token_ids))
        self.target_len.append(req.params.max_tokens)
        self.num_tokens.append(len(req.output_token_ids))
        self.scheduled_s.append(req.scheduled_s)
        self.sent_s.append(req.start_s)
        self.first_step.append(req.run_first_step)
        self.last_step.append(req.run_last_step)
        if req.earlier_runs:
            self.earlier_runs[row] = list(req.earlier_runs)

    def add_failed(self, index: int, prompt_len: int | None, target_len: int, scheduled_s: float, sent_s: float,
                   end_s: float, status: int, error: str) -> None:
        self.failed.append(RequestRecord(
            index=index, prompt_len=prompt_len, target_output_len=target_len, scheduled_s=scheduled_s - self.start_s,
            start_s=sent_s - self.start_s, end_s=end_s - self.start_s, status_code=status, error=error))

    @property
    def num_requests(self) -> int:
        return len(self.index) + len(self.failed)

    # --- summary -----------------------------------------------------------------------------------
    def summarize(self, step_end_s: list[array], slo: SLO | None, records_limit: int) -> BenchResult:
        """`step_end_s[r]`: replica r's step end times (its whole history, absolute seconds)."""
        offsets = np.cumsum([0] + [len(e) for e in step_end_s])
        flat = np.concatenate([np.frombuffer(e, dtype=np.float64) for e in step_end_s]) if step_end_s else np.zeros(0)
        chunk_s = (flat + self.token_delay_s) - self.start_s  # every step's tokens, at the client
        replica = np.frombuffer(self.replica, dtype=np.int64)
        base = offsets[:-1][replica] if len(replica) else np.zeros(0, dtype=np.int64)
        first = base + np.frombuffer(self.first_step, dtype=np.int64)
        last = base + np.frombuffer(self.last_step, dtype=np.int64)
        sent = np.frombuffer(self.sent_s, dtype=np.float64) - self.start_s
        earlier = {row: [(b + a0, b + a1) for a0, a1 in runs]
                   for row, runs in self.earlier_runs.items() for b in [int(base[row])]}
        if self.num_requests <= records_limit:
            return self._via_records(chunk_s, first, last, earlier, sent, slo)
        return self._direct(chunk_s, offsets, first, last, earlier, sent, slo)

    def _via_records(self, chunk_s, first, last, earlier, sent, slo) -> BenchResult:
        records = list(self.failed)
        num_tokens = np.frombuffer(self.num_tokens, dtype=np.int64)
        scheduled = np.frombuffer(self.scheduled_s, dtype=np.float64) - self.start_s
        for row in range(len(self.index)):
            runs = [*earlier.get(row, ()), (int(first[row]), int(last[row]))]
            times = tuple(float(t) for a, b in runs for t in chunk_s[a:b + 1])
            records.append(RequestRecord(
                index=self.index[row], prompt_len=self.prompt_len[row], target_output_len=self.target_len[row],
                scheduled_s=float(scheduled[row]), start_s=float(sent[row]), end_s=times[-1], chunk_times_s=times,
                num_output_tokens=int(num_tokens[row]), tokens_from_usage=True, status_code=200))
        records.sort(key=lambda r: r.index)
        wall_s = max((r.end_s for r in records), default=0.0)
        return summarize_run(records, self.level, wall_s, slo)

    def _direct(self, chunk_s, offsets, first, last, earlier, sent, slo) -> BenchResult:
        """summarize_run's numbers without RequestRecords (see the module docstring)."""
        num_tokens = np.frombuffer(self.num_tokens, dtype=np.int64)
        first_chunk, end = chunk_s[first], chunk_s[last]
        for row, runs in earlier.items():
            first_chunk[row] = chunk_s[runs[0][0]]
        ttft, e2e = first_chunk - sent, end - sent
        multi = num_tokens >= 2
        tpot = (e2e[multi] - ttft[multi]) / (num_tokens[multi] - 1)
        gaps, counts = self._itl_sample(chunk_s, offsets, first, last, earlier)
        ends_s = [r.end_s for r in self.failed] + ([float(end.max())] if len(end) else [])
        wall_s = max(ends_s, default=0.0)
        num_ok = len(self.index)
        num_output = int(num_tokens.sum())
        goodput = None
        if slo is not None:
            met = np.ones(num_ok, dtype=bool)
            tpot_all = np.where(multi, (e2e - ttft) / np.maximum(num_tokens - 1, 1), np.nan)
            if slo.ttft_ms is not None:
                met &= ttft * 1000.0 <= slo.ttft_ms
            if slo.tpot_ms is not None:
                met &= ~multi | (tpot_all * 1000.0 <= slo.tpot_ms)
            if slo.e2e_ms is not None:
                met &= e2e * 1000.0 <= slo.e2e_ms
            goodput = int(met.sum()) / max(wall_s, 1e-9)
        wall = max(wall_s, 1e-9)
        return BenchResult(
            level=self.level, num_requests=self.num_requests, num_ok=num_ok, num_failed=len(self.failed),
            num_rate_limited=sum(r.status_code == 429 for r in self.failed), wall_time_s=wall_s,
            total_input_tokens=int(np.frombuffer(self.prompt_len, dtype=np.int64).sum()),
            total_output_tokens=num_output, request_throughput_qps=num_ok / wall, output_throughput_tok_s=num_output / wall,
            ttft=summarize_ms(ttft.tolist()), tpot=summarize_ms(tpot.tolist()), itl=weighted_summary_ms(gaps, counts),
            e2e=summarize_ms(e2e.tolist()), slo=slo, goodput_qps=goodput, error_samples=_error_samples(self.failed), records=(),
        )

    def _itl_sample(self, chunk_s, offsets, first, last, earlier) -> tuple[np.ndarray, np.ndarray]:
        """Gaps between consecutive tokens of every request, as (gap, how many times)."""
        # a run (a, b) has gaps at steps a+1 .. b: +1 there in a difference array over all steps
        runs_a, runs_b = [first], [last]
        cross: list[float] = []
        for row, runs in earlier.items():
            chain = [*runs, (int(first[row]), int(last[row]))]
            runs_a.append(np.array([a for a, _ in runs], dtype=np.int64))
            runs_b.append(np.array([b for _, b in runs], dtype=np.int64))
            cross += [float(chunk_s[nxt[0]] - chunk_s[prev[1]]) for prev, nxt in zip(chain, chain[1:])]
        a, b = np.concatenate(runs_a), np.concatenate(runs_b)
        diff = np.zeros(len(chunk_s) + 1, dtype=np.int64)
        np.add.at(diff, a + 1, 1)
        np.add.at(diff, b + 1, -1)
        counts = np.cumsum(diff)[:-1]
        step_gap = np.empty(len(chunk_s))
        step_gap[1:] = chunk_s[1:] - chunk_s[:-1]
        step_gap[offsets[:-1][offsets[:-1] < len(chunk_s)]] = np.nan  # no gap across replicas
        used = counts > 0
        return (np.concatenate([step_gap[used], np.array(cross)]),
                np.concatenate([counts[used], np.ones(len(cross), dtype=np.int64)]))


def weighted_summary_ms(values_s: np.ndarray, counts: np.ndarray) -> LatencySummary:
    """`summarize_ms` of the sample holding each value `counts` times, without expanding it:
    numpy's linear-interpolation percentiles, read off the cumulative counts."""
    total = int(counts.sum()) if len(counts) else 0
    if total == 0:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan)
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    order = np.argsort(values_ms, kind="stable")
    values_ms, counts = values_ms[order], counts[order]
    ends = np.cumsum(counts)  # sorted sample positions [ends[i] - counts[i], ends[i]) hold values_ms[i]

    def at(position: int) -> float:
        return float(values_ms[np.searchsorted(ends, position, side="right")])

    quantiles = []
    for q in np.true_divide(PERCENTILES, 100):
        virtual = (total - 1) * q
        lower = math.floor(virtual)
        if virtual >= total - 1:
            quantiles.append(at(total - 1))
            continue
        a, b, t = at(lower), at(lower + 1), virtual - lower
        diff = b - a
        quantiles.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    mean_ms = float(np.dot(values_ms, counts) / total)
    return LatencySummary(total, mean_ms, *quantiles)
