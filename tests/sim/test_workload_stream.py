"""`iter_workload` draws the same requests as `build_workload`, lazily."""
from __future__ import annotations

import json

import pytest

from shardserve.sim.workload import RequestSpec, WorkloadConfig, build_workload, iter_workload


@pytest.mark.parametrize("config", [
    WorkloadConfig(5000, "random", input_len=37, output_len=9, range_ratio=0.9, request_rate_qps=3.0, seed=4,
                   prompt_salt=2),  # odd lengths, batches of prompts drawn at once
    WorkloadConfig(9000, "random", input_len=1, output_len=1, request_rate_qps=2.0, burstiness=0.5),
    WorkloadConfig(300, "sharegpt", seed=1),  # closed loop: every arrival at 0
    WorkloadConfig(0, "random"),
])
def test_stream_equals_the_built_workload(config):
    assert list(iter_workload(config)) == build_workload(config)


def test_stream_of_a_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt": [1, 2, i], "output_len": 3, "arrival_time_s": 5 - i})
                               for i in range(5)))
    config = WorkloadConfig(4, f"jsonl:{trace}")
    # the trace's first 4 records, in file order, each as written
    expected = [RequestSpec((1, 2, i), None, 3, 5.0 - i) for i in range(4)]
    assert list(iter_workload(config)) == expected and build_workload(config) == expected


def test_stream_is_lazy():
    stream = iter_workload(WorkloadConfig(200_000, "random", input_len=5000, output_len=1, request_rate_qps=1.0))
    first = next(stream)  # a billion prompt tokens are not drawn up front
    assert first.prompt_len == 5000
