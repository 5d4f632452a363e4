"""Large levels are summarized straight from steps, small ones through bench's summarize_run on
RequestRecords: both must report the same numbers."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from shardserve.bench.stats import LoadLevel, parse_slo, summarize_ms
from shardserve.sim.simulation import ServingOverheads, Simulation
from shardserve.sim.sim_results import weighted_summary_ms
from tests.sim.sim_helpers import config, shared_prefix_specs


def close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


@pytest.mark.parametrize("kwargs", [
    dict(num_kv_blocks=80, max_model_len=1024),  # preemptions: requests with several runs of tokens
    dict(replicas=3, max_model_len=300, max_waiting_requests=4, overheads=ServingOverheads(0.001, 0.0005)),  # errors
])
def test_direct_summary_equals_summarize_run_on_records(kwargs):
    slo = parse_slo("ttft_ms=300,tpot_ms=40")
    specs = shared_prefix_specs(150, 60.0, seed=3)
    by_records = Simulation(config(records_limit=10**9, **kwargs)).run_level(LoadLevel(None, 60.0), specs, slo)
    direct = Simulation(config(records_limit=0, **kwargs)).run_level(LoadLevel(None, 60.0), specs, slo)
    assert direct.records == () and len(by_records.records) == 150
    for field in dataclasses.fields(by_records):
        if field.name == "records":
            continue
        a, b = getattr(by_records, field.name), getattr(direct, field.name)
        if dataclasses.is_dataclass(a):
            assert all(close(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)), field.name
        else:
            assert close(a, b), field.name


def test_weighted_summary_is_summarize_ms_of_the_expanded_sample():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100, 1000):
        values = rng.exponential(0.02, size=size)
        values[rng.random(size) < 0.3] = 0.015  # ties
        counts = rng.integers(1, 50, size=size)
        expected = summarize_ms(np.repeat(values, counts).tolist())
        got = weighted_summary_ms(values, counts)
        assert got.count == expected.count
        for name in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"):
            assert math.isclose(getattr(got, name), getattr(expected, name), rel_tol=1e-12), (size, name)
    assert math.isnan(weighted_summary_ms(np.zeros(0), np.zeros(0, dtype=np.int64)).p50_ms)
