"""The calibration fit recovers known efficiency factors from step times the cost model itself
generated, and the fitted model round-trips through the calibration file into the planner."""
from __future__ import annotations

import dataclasses
import json

import pytest

from shardserve.config import ModelConfig, ParallelConfig
from shardserve.planner.cost_model import Deployment, step_time
from shardserve.planner.efficiency import Efficiency, calibration_document, load_calibration
from shardserve.planner.hardware import Hardware
from shardserve.profiler.calibration_fit import FitSample, fit_efficiency

# SmolLM2-135M's shape, on a CPU-like device
MODEL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
HOST = Hardware(name="this host", vendor="measured", peak_flop_s={"float32": 200e9}, memory_bytes=24 * 2**30,
                memory_bandwidth_bytes_s=35e9, intra_node_bandwidth_bytes_s=0.0, intra_node_latency_s=0.0,
                inter_node_bandwidth_bytes_s=0.0, inter_node_latency_s=0.0, devices_per_node=1, power_w=0.0,
                price_per_hour_usd=0.0, sources=("test",))
TRUE = Efficiency(gemm=0.8, attention=0.3, decode_attention=0.07, memory=0.7, overlap=0.4,
                  step_overhead_s=2e-3, seq_overhead_s=1e-4, token_overhead_s=1e-4, activation_traffic=0.0)


def _batches():
    prefill = [[(n, n)] * b for b, n in ((1, 16), (1, 64), (1, 256), (1, 1024), (4, 64), (4, 256), (16, 64))]
    decode = [[(1, c)] * b for c in (32, 256, 1024) for b in (1, 2, 4, 8, 16, 32, 64)]
    mixed = [[(1, c)] * b + [(n, n)] for b, c, n in ((4, 128, 64), (16, 256, 128), (32, 128, 512))]
    return [("prefill", b) for b in prefill] + [("decode", b) for b in decode] + [("mixed", b) for b in mixed]


def _samples(true: Efficiency, host_share: bool = True) -> list[FitSample]:
    dep = Deployment(MODEL, ParallelConfig(), HOST, "float32", true)
    samples = []
    for kind, batch in _batches():
        t = step_time(dep, batch)
        samples.append(FitSample(kind, tuple(batch), t.total_s, t.overhead_s if host_share else None))
    return samples


def test_fit_recovers_known_factors():
    prior = Deployment(MODEL, ParallelConfig(), HOST, "float32")
    result = fit_efficiency(prior, _samples(TRUE), "synthetic")
    eff = result.efficiency
    assert result.mape < 0.005
    assert eff.calibrated and eff.source == "synthetic" and eff.step_time_mape == pytest.approx(result.mape)
    for name in ("gemm", "attention", "decode_attention", "memory", "overlap"):
        assert getattr(eff, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    for name in ("step_overhead_s", "seq_overhead_s", "token_overhead_s"):
        assert getattr(eff, name) == pytest.approx(getattr(TRUE, name), rel=0.1, abs=2e-5), name
    assert eff.network == prior.efficiency.network  # a single-device profile has no communication
    # the per-token host term carries the elementwise work: the activation traffic is not counted again
    assert prior.efficiency.activation_traffic == 1.0 and eff.activation_traffic == 0.0
    assert "network" not in result.fitted
    assert set(result.mape_by_kind) == {"prefill", "decode", "mixed"}


def test_fit_on_totals_alone_still_predicts():
    result = fit_efficiency(Deployment(MODEL, ParallelConfig(), HOST, "float32"), _samples(TRUE, False), "x")
    assert result.mape < 0.01


def test_fitted_model_round_trips_through_the_file(tmp_path):
    result = fit_efficiency(Deployment(MODEL, ParallelConfig(), HOST, "float32"), _samples(TRUE), "synthetic run")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration_document("synthetic run", "this host", result.efficiency, HOST,
                                                    {"num_samples": result.num_samples})))
    calibration = load_calibration(path)
    eff = calibration.for_device("this host")
    assert dataclasses.replace(eff, source="", step_time_mape=None) == dataclasses.replace(
        result.efficiency, source="", step_time_mape=None)
    assert calibration.hardware_for("This-Host") == HOST
    dep = Deployment(MODEL, ParallelConfig(), calibration.hardware_for("this host"), "float32", eff)
    for sample, predicted in zip(_samples(TRUE), result.predicted_s):
        assert step_time(dep, sample.batch).total_s == pytest.approx(predicted, rel=1e-9)
