"""The cost-model terms a CPU calibration needs (host overhead per sequence and token, decode
attention factor, compute/memory overlap) and the calibration file versions that carry them."""
from __future__ import annotations

import json

import pytest

from shardserve.config import ConfigError, ModelConfig, ParallelConfig
from shardserve.planner.cost_model import Deployment, roof_s, step_time, step_work
from shardserve.planner.efficiency import Efficiency, load_calibration
from shardserve.planner.hardware import Hardware

MODEL = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
                    num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
HW = Hardware(name="box", vendor="x", peak_flop_s={"float32": 1e11}, memory_bytes=2**34,
              memory_bandwidth_bytes_s=1e10, intra_node_bandwidth_bytes_s=0.0, intra_node_latency_s=0.0,
              inter_node_bandwidth_bytes_s=0.0, inter_node_latency_s=0.0, devices_per_node=1, power_w=0.0,
              price_per_hour_usd=0.0, sources=("test",))


def dep(**eff) -> Deployment:
    return Deployment(MODEL, ParallelConfig(), HW, "float32", Efficiency(**eff))


def test_host_overhead_grows_with_sequences_and_tokens():
    base = dict(step_overhead_s=1e-3, seq_overhead_s=1e-4, token_overhead_s=1e-5)
    batch = [(1, 100)] * 3 + [(50, 50)]
    t = step_time(dep(**base), batch)
    assert t.overhead_s == pytest.approx(1e-3 + 4 * 1e-4 + 53 * 1e-5)
    no_host = step_time(dep(step_overhead_s=0.0), batch)
    assert t.total_s - no_host.total_s == pytest.approx(t.overhead_s)


def test_overlap_moves_between_max_and_sum():
    assert roof_s(3.0, 1.0, 1.0) == 3.0 and roof_s(3.0, 1.0, 0.0) == 4.0 and roof_s(1.0, 3.0, 0.5) == 3.5
    batch = [(1, 64)] * 8
    classic, additive = step_time(dep(overlap=1.0), batch), step_time(dep(overlap=0.0), batch)
    assert additive.total_s > classic.total_s
    prior = step_time(dep(), batch).total_s  # the prior hides part of the shorter time, not all
    assert classic.total_s < prior < additive.total_s


def test_decode_attention_factor_only_slows_decodes():
    decode, prefill = [(1, 2000)] * 16, [(512, 512)]
    slow = dict(decode_attention=0.01)
    assert step_time(dep(**slow), decode).attention_s > 10 * step_time(dep(), decode).attention_s
    assert step_time(dep(**slow), prefill).attention_s == step_time(dep(), prefill).attention_s
    assert Efficiency().decode_attention_factor == Efficiency().attention


def test_step_work_counts_what_step_time_divides():
    batch = [(1, 300)] * 4 + [(64, 64)]
    unit = Deployment(MODEL, ParallelConfig(), HW, "float32", Efficiency(gemm=1, attention=1, memory=1,
                                                                         step_overhead_s=0))
    work, t = step_work(unit, batch), step_time(unit, batch)
    assert t.gemm_s + t.attention_s == pytest.approx(work.flops / 1e11)
    assert t.memory_s == pytest.approx((work.bytes + work.activation_traffic_bytes) / 1e10)


@pytest.mark.parametrize("bad", [dict(seq_overhead_s=-1), dict(token_overhead_s=-1e-9), dict(overlap=1.5),
                                 dict(decode_attention=0.0), dict(activation_traffic=-1.0)])
def test_new_terms_are_validated(bad):
    with pytest.raises(ConfigError):
        Efficiency(**bad)


def test_version_1_files_still_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "shardserve-efficiency/1", "devices": {"H100": {"gemm": 0.5}}}))
    eff = load_calibration(path).for_device("H100 SXM", ("h100",))
    assert eff.gemm == 0.5 and eff.calibrated
    # what the "/1" fit assumed: no per-item host terms, one attention factor, the classic roofline
    assert (eff.seq_overhead_s, eff.token_overhead_s, eff.decode_attention, eff.overlap) == (0.0, 0.0, None, 1.0)
    assert eff.activation_traffic == 0.0 < Efficiency().activation_traffic  # fitted without it
    assert Efficiency().overlap < 1.0  # (not the prior)
    assert load_calibration(path).hardware_for("H100") is None
    path.write_text(json.dumps({"format": "shardserve-efficiency/9", "devices": {"H100": {}}}))
    with pytest.raises(ConfigError, match="shardserve-efficiency/2"):
        load_calibration(path)
