"""What a benchmark run measured: per-request records in, latency percentiles, throughput and
goodput out. Pure Python + numpy, so the simulator can summarize its simulated requests the same way.

Definitions (all per request, from the moment the request was sent):
  TTFT  time to the first non-empty content chunk
  ITL   gaps between consecutive content chunks (pooled over all requests)
  TPOT  (E2E - TTFT) / (output tokens - 1); undefined for single-token outputs
  E2E   time to the end of the response stream
Throughput is over the run's wall time (start of the run to the last request's end), counting
successful requests only. Goodput counts successful requests that meet every SLO term.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from shardserve.config import ConfigError

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds since the start of the run (one
    monotonic clock); `chunk_times_s` are the arrivals of non-empty content chunks."""

    index: int
    prompt_len: int | None
    target_output_len: int
    scheduled_s: float  # when the workload wanted it sent (open loop) or 0 (closed loop)
    start_s: float  # when it was actually sent
    end_s: float
    chunk_times_s: tuple[float, ...] = ()
    num_output_tokens: int = 0
    tokens_from_usage: bool = False  # False: the server sent no usage; tokens = content chunks
    status_code: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        ttft_s = self.ttft_s
        if ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - ttft_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return np.diff(self.chunk_times_s).tolist() if len(self.chunk_times_s) > 1 else []


@dataclass(frozen=True)
class LatencySummary:
    """Mean and percentiles of one latency, in milliseconds; NaN when there were no samples."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float


def summarize_ms(values_s: list[float]) -> LatencySummary:
    """Mean, p50, p90, p99 of `values_s` (seconds) in ms, with numpy's linear interpolation."""
    if not values_s:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan)
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(values_ms, PERCENTILES).tolist()
    return LatencySummary(len(values_ms), float(values_ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must all meet to count toward goodput; None terms are not checked.
    A single-token output has no TPOT, so it meets any TPOT target."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft_s, tpot_s = record.ttft_s, record.tpot_s
        if self.ttft_ms is not None and (ttft_s is None or ttft_s * 1000.0 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and tpot_s is not None and tpot_s * 1000.0 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e_s * 1000.0 <= self.e2e_ms


def parse_slo(text: str) -> SLO:
    """Parse `ttft_ms=500,tpot_ms=50` (any of ttft_ms, tpot_ms, e2e_ms; each positive, at most once).
    Raises ConfigError with a one-line message on anything else."""
    names = [f.name for f in dataclasses.fields(SLO)]
    values: dict[str, float] = {}
    for term in (t.strip() for t in text.split(",")):
        key, sep, raw = term.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise ConfigError(f"--slo: bad term {term!r}; expected NAME=VALUE with NAME one of {', '.join(names)}")
        if key in values:
            raise ConfigError(f"--slo: {key} given twice")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--slo: {key} must be a number, got {raw.strip()!r}") from None
        if not 0 < value < math.inf:
            raise ConfigError(f"--slo: {key} must be a positive finite number, got {raw.strip()}")
        values[key] = value
    return SLO(**values)


@dataclass(frozen=True)
class LoadLevel:
    """The offered load of one run: a closed loop of `concurrency` workers, or an open loop at
    `request_rate_qps` (inf: all at once; None: the workload's own arrival times, e.g. a trace's),
    optionally capped at `concurrency` in flight."""

    concurrency: int | None = None
    request_rate_qps: float | None = None
    burstiness: float = 1.0

    @property
    def label(self) -> str:
        if self.request_rate_qps is None and self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        rate = "workload arrivals" if self.request_rate_qps is None else f"{self.request_rate_qps:g} qps"
        cap = f", max concurrency {self.concurrency}" if self.concurrency is not None else ""
        burst = f", burstiness {self.burstiness:g}" if self.burstiness != 1.0 else ""
        return f"rate={rate}{burst}{cap}"


@dataclass(frozen=True)
class BenchResult:
    """The summary of one run at one load level, with its request records for plots."""

    level: LoadLevel
    num_requests: int
    num_ok: int
    num_failed: int  # every failed request, the 429s included
    num_rate_limited: int  # HTTP 429
    wall_time_s: float
    total_input_tokens: int  # 0 for text prompts (not tokenized client-side)
    total_output_tokens: int
    request_throughput_qps: float
    output_throughput_tok_s: float
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    slo: SLO | None
    goodput_qps: float | None
    error_samples: tuple[str, ...]
    records: tuple[RequestRecord, ...]

    def to_dict(self, include_requests: bool = True) -> dict:
        """Plain JSON-ready data; records gain their derived ttft_s / tpot_s / e2e_s."""
        out = dataclasses.asdict(self)
        out["level"]["label"] = self.level.label
        out["records"] = [_record_dict(r) for r in self.records] if include_requests else []
        return _json_safe(out)

def _record_dict(record: RequestRecord) -> dict:
    return {**dataclasses.asdict(record), "ttft_s": record.ttft_s, "tpot_s": record.tpot_s, "e2e_s": record.e2e_s}


def _json_safe(value):
    """NaN / inf are not JSON; write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def summarize_run(records: list[RequestRecord], level: LoadLevel, wall_time_s: float,
                  slo: SLO | None = None) -> BenchResult:
    """Reduce one run's records to a BenchResult. Failed requests count in num_failed and nowhere
    else: latencies and throughput describe the successful ones."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    wall_s = max(wall_time_s, 1e-9)
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    goodput = None if slo is None else sum(slo.is_met(r) for r in ok) / wall_s
    return BenchResult(
        level=level, num_requests=len(records), num_ok=len(ok), num_failed=len(failed),
        num_rate_limited=sum(r.status_code == 429 for r in failed), wall_time_s=wall_time_s,
        total_input_tokens=sum(r.prompt_len or 0 for r in ok), total_output_tokens=num_output_tokens,
        request_throughput_qps=len(ok) / wall_s, output_throughput_tok_s=num_output_tokens / wall_s,
        ttft=summarize_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=summarize_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=summarize_ms([gap for r in ok for gap in r.itls_s]),
        e2e=summarize_ms([r.e2e_s for r in ok]),
        slo=slo, goodput_qps=goodput, error_samples=_error_samples(failed), records=tuple(records),
    )


def _error_samples(failed: list[RequestRecord], max_samples: int = 5) -> tuple[str, ...]:
    """The first few distinct error messages, with how often each occurred."""
    counts: dict[str, int] = {}
    for r in failed:
        counts[r.error or "unknown"] = counts.get(r.error or "unknown", 0) + 1
    return tuple(f"{n}x {msg}" for msg, n in list(counts.items())[:max_samples])
