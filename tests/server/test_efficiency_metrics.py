"""Live efficiency metrics: MFU, MBU and cost per million tokens over a recent window, and the
step-time histogram by kind, from the engine's step records (no profiler in the serving path)."""
from __future__ import annotations

import json
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shardserve.config import ModelConfig, ParallelConfig
from shardserve.engine.interface import StepRecord
from shardserve.planner.cost_model import Deployment, step_work
from shardserve.planner.efficiency import Efficiency, calibration_document
from shardserve.planner.hardware import Hardware
from shardserve.server.efficiency_metrics import EfficiencyConfig, LiveEfficiency, step_kind
from tests.server_process import running_server, scrape, scrape_many

MODEL = ModelConfig(architecture="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
HOST = Hardware(name="this host", vendor="measured", peak_flop_s={"float32": 1e9}, memory_bytes=2**30,
                memory_bandwidth_bytes_s=1e9, intra_node_bandwidth_bytes_s=0.0, intra_node_latency_s=0.0,
                inter_node_bandwidth_bytes_s=0.0, inter_node_latency_s=0.0, devices_per_node=1, power_w=0.0,
                price_per_hour_usd=0.0, sources=("test",))


def test_window_utilization_and_cost(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("shardserve.server.efficiency_metrics.time.monotonic", lambda: clock[0])
    dep = Deployment(MODEL, ParallelConfig(), HOST, "float32")
    live = LiveEfficiency(CollectorRegistry(), "m", EfficiencyConfig(dep, price_per_device_hour_usd=3.6,
                                                                      window_s=10.0))
    assert math.isnan(live.cost_per_million_tokens_usd()) and live.mfu() == 0
    decode = ((1, 50),) * 4
    clock[0] = 102.0  # two seconds after start: the window is those two seconds
    live.observe(StepRecord(decode, 0.01), num_output_tokens=4)
    work = step_work(dep, decode)
    assert live.mfu() == pytest.approx(work.flops / (2.0 * 1e9))
    assert live.mbu() == pytest.approx(work.bytes / (2.0 * 1e9))
    # $3.6 per hour is $0.002 for two seconds, over 4 tokens
    assert live.cost_per_million_tokens_usd() == pytest.approx(0.002 / 4 * 1e6)
    clock[0] = 120.0  # the step left the window: idle
    assert live.mfu() == 0 and math.isnan(live.cost_per_million_tokens_usd())


def test_step_kinds():
    assert step_kind(((5, 5),)) == "prefill"
    assert step_kind(((1, 9), (1, 4))) == "decode"
    assert step_kind(((1, 9), (7, 7))) == "mixed"


def test_server_exports_efficiency_metrics(tiny_checkpoints, tmp_path):
    # peaks from a calibration file (no probe at startup), price from the flag
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(calibration_document("test", "this host", Efficiency(calibrated=True), HOST)))
    args = ("--model", str(tiny_checkpoints["llama"]), "--kv-cache-memory", str(8 << 20),
            "--calibration", str(calibration), "--device-price-per-hour", "2.5")
    with running_server(*args) as (url, _):
        assert math.isnan(scrape(url, "shardserve:cost_per_million_tokens_usd"))  # nothing served yet
        body = {"model": str(tiny_checkpoints["llama"]), "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        gauges = scrape_many(url, ("shardserve:mfu", "shardserve:mbu", "shardserve:cost_per_million_tokens_usd"))
        assert 0 < gauges["shardserve:cost_per_million_tokens_usd"] < math.inf
        # both gauges divide the window's work by its seconds (read microseconds apart) and the
        # peaks (1e9 each): their ratio is the steps' FLOPs over their bytes, as the planner counts
        # them for this model
        config = ModelConfig.from_hf_config(json.loads((tiny_checkpoints["llama"] / "config.json").read_text()))
        dtype = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["dtype"]
        dep = Deployment(config, ParallelConfig(), HOST, dtype)
        works = [step_work(dep, batch) for batch in [((4, 4),)] + [((1, n),) for n in range(5, 10)]]
        assert gauges["shardserve:mfu"] > 0
        assert gauges["shardserve:mfu"] / gauges["shardserve:mbu"] == pytest.approx(
            sum(w.flops for w in works) / sum(w.bytes for w in works), rel=1e-3)
        text = httpx.get(f"{url}/metrics", timeout=5).text
        steps = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "shardserve:step_time_seconds_count":
                    steps[s.labels["kind"]] = s.value
        assert steps["prefill"] == 1 and steps["decode"] == 5 and steps["mixed"] == 0
