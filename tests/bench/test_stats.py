"""Benchmark statistics: derived per-request latencies, percentiles, throughput, goodput, SLO parsing."""
from __future__ import annotations

import json
import math

import pytest

from shardserve.bench.stats import (
    SLO, LoadLevel, RequestRecord, parse_slo, summarize_ms, summarize_run,
)
from shardserve.config import ConfigError


def record(index=0, start_s=0.0, chunks=(0.1, 0.2, 0.3), end_s=0.35, tokens=None, **kwargs) -> RequestRecord:
    return RequestRecord(index=index, prompt_len=8, target_output_len=len(chunks), scheduled_s=0.0,
                         start_s=start_s, end_s=end_s, chunk_times_s=tuple(chunks),
                         num_output_tokens=len(chunks) if tokens is None else tokens, **kwargs)


def test_record_derived_latencies():
    r = record(start_s=1.0, chunks=(1.2, 1.25, 1.4), end_s=1.6, tokens=5)
    assert r.ok
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.6)
    assert r.tpot_s == pytest.approx((0.6 - 0.2) / 4)  # from token count, not chunk count
    assert r.itls_s == pytest.approx([0.05, 0.15])


def test_record_without_chunks_or_with_one_token():
    assert record(chunks=(), tokens=0).ttft_s is None
    single = record(chunks=(0.1,), tokens=1)
    assert single.tpot_s is None and single.itls_s == []


def test_summarize_ms_interpolates_between_the_ranks():
    # 10, 20, ..., 100 ms: the p-th percentile sits at rank p/100 x 9, between its neighbours
    s = summarize_ms([(i + 1) / 100 for i in range(10)][::-1])
    assert s.count == 10
    assert [s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms] == pytest.approx([55.0, 55.0, 91.0, 99.1])


def test_summarize_ms_empty_is_nan():
    s = summarize_ms([])
    assert s.count == 0 and all(math.isnan(v) for v in (s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms))


def _mixed_records() -> list[RequestRecord]:
    return [
        # ttft 100 ms, tpot (400-100)/3 = 100 ms
        record(0, 0.0, (0.1, 0.2, 0.3, 0.4), 0.4),
        # ttft 50 ms, tpot (250-50)/4 = 50 ms
        record(1, 0.0, (0.05, 0.1, 0.15, 0.2, 0.25), 0.25),
        # ttft 600 ms, tpot 10 ms
        record(2, 0.5, (1.1, 1.11), 1.11),
        # single token: no TPOT, meets any TPOT target; ttft 20 ms
        record(3, 1.0, (1.02,), 1.02),
        record(4, 1.0, (), 1.5, tokens=0, status_code=429, error="HTTP 429: busy"),
        record(5, 1.0, (1.1,), 2.0, tokens=1, status_code=200, error="timed out after 1 s"),
    ]


def test_summarize_run_counts_throughput_and_latencies():
    result = summarize_run(_mixed_records(), LoadLevel(concurrency=2), wall_time_s=2.0)
    assert (result.num_requests, result.num_ok, result.num_failed, result.num_rate_limited) == (6, 4, 2, 1)
    assert result.total_output_tokens == 4 + 5 + 2 + 1  # failed requests' tokens do not count
    assert result.total_input_tokens == 4 * 8
    assert result.request_throughput_qps == pytest.approx(4 / 2.0)
    assert result.output_throughput_tok_s == pytest.approx(12 / 2.0)
    assert result.ttft.count == 4 and result.ttft.mean_ms == pytest.approx((100 + 50 + 600 + 20) / 4)
    assert result.tpot.count == 3 and result.tpot.p50_ms == pytest.approx(50)
    assert result.itl.count == 3 + 4 + 1
    assert result.goodput_qps is None
    assert result.error_samples == ("1x HTTP 429: busy", "1x timed out after 1 s")


@pytest.mark.parametrize("slo, expected_ok", [
    (SLO(ttft_ms=200), 3),  # not the 600 ms TTFT
    (SLO(tpot_ms=60), 3),  # not the 100 ms TPOT; single-token request passes
    (SLO(ttft_ms=200, tpot_ms=60), 2),
    (SLO(e2e_ms=300), 2),  # 250 ms and 20 ms
    (SLO(ttft_ms=1), 0),
])
def test_goodput_matches_hand_count(slo, expected_ok):
    result = summarize_run(_mixed_records(), LoadLevel(concurrency=1), wall_time_s=4.0, slo=slo)
    assert result.goodput_qps == pytest.approx(expected_ok / 4.0)


def test_to_dict_is_valid_json_with_nan_as_null():
    result = summarize_run([record(0, chunks=(0.1,), end_s=0.1, tokens=1)], LoadLevel(request_rate_qps=2.0),
                           wall_time_s=1.0, slo=SLO(ttft_ms=100))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["tpot"]["mean_ms"] is None  # no TPOT samples -> NaN -> null
    assert data["level"]["label"] == "rate=2 qps"
    assert data["slo"] == {"ttft_ms": 100, "tpot_ms": None, "e2e_ms": None}
    assert data["records"][0]["ttft_s"] == pytest.approx(0.1)
    assert json.loads(json.dumps(result.to_dict(include_requests=False)))["records"] == []


def test_load_level_labels():
    assert LoadLevel(concurrency=8).label == "concurrency=8"
    assert LoadLevel(request_rate_qps=4.0).label == "rate=4 qps"
    assert LoadLevel(4, math.inf, 0.5).label == "rate=inf qps, burstiness 0.5, max concurrency 4"
    assert LoadLevel().label == "rate=workload arrivals"


def test_parse_slo():
    assert parse_slo("ttft_ms=500,tpot_ms=50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo(" e2e_ms = 2000 ") == SLO(e2e_ms=2000)


@pytest.mark.parametrize("text, message", [
    ("ttft=500", "bad term"),
    ("ttft_ms", "bad term"),
    ("ttft_ms=fast", "must be a number"),
    ("ttft_ms=0", "positive"),
    ("tpot_ms=-5", "positive"),
    ("tpot_ms=inf", "positive"),
    ("ttft_ms=1,ttft_ms=2", "twice"),
    ("", "bad term"),
])
def test_parse_slo_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_slo(text)
