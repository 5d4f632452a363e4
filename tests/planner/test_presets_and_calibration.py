"""Model presets and --model resolution; the calibration file format."""
from __future__ import annotations

import json

import pytest

from shardserve.config import ConfigError
from shardserve.planner.efficiency import CALIBRATION_FORMAT, Efficiency, load_calibration
from shardserve.planner.model_presets import preset, preset_names, resolve_model


def test_presets_have_the_published_shapes():
    assert preset_names() == ["deepseek-v3", "llama-3.1-405b", "llama-3.1-70b", "llama-3.1-8b", "llama-4-maverick",
                              "llama-4-scout", "mixtral-8x22b", "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b"]
    llama = preset("llama-3.1-70b")
    assert (llama.num_layers, llama.hidden_size, llama.num_kv_heads, llama.vocab_size) == (80, 8192, 8, 128256)
    mixtral = preset("mixtral-8x7b")
    assert mixtral.is_moe and (mixtral.num_experts, mixtral.num_experts_per_token) == (8, 2)
    assert mixtral.moe_intermediate_size == 14336 and mixtral.dense_layer_ids == ()
    qwen = preset("qwen3-30b-a3b")
    assert qwen.architecture == "qwen3_moe" and qwen.qk_norm
    assert (qwen.num_experts, qwen.num_experts_per_token, qwen.moe_intermediate_size) == (128, 8, 768)
    assert (qwen.num_kv_heads, qwen.head_dim) == (4, 128)
    big = preset("qwen3-235b-a22b")  # "235B total, 22B active"
    assert 234e9 < big.num_params < 236e9


def active_params(model) -> float:
    return sum(model.active_params_per_layer()) + model.vocab_size * model.hidden_size * 2


@pytest.mark.parametrize("name, total, active", [
    # the model cards' "671B total, 37B activated" (DeepSeek-V3 without its 14B multi-token-prediction
    # layer), Llama 4 "17B active" of 109B / 400B (the text model: the vision tower is left out)
    ("deepseek-ai/DeepSeek-R1", 671e9, 37e9), ("llama-4-scout", 108e9, 17e9), ("llama-4-maverick", 400e9, 17e9),
    ("mixtral-8x22b", 141e9, 39e9)])
def test_planner_only_presets_count_their_published_parameters(name, total, active):
    model = preset(name)
    assert abs(model.num_params / total - 1) < 0.01
    assert abs(active_params(model) / active - 1) < 0.03


def test_deepseek_v3_is_latent_attention_with_three_dense_layers():
    model = preset("deepseek-v3")
    assert model.mla is not None and model.mla.latent_width == 512 + 64
    assert model.dense_layer_ids == (0, 1, 2) and (model.num_experts, model.num_experts_per_token) == (256, 8)
    assert model.shared_expert_intermediate_size == 2048
    # the cache holds the latent, not 128 heads of K and V: 61 layers x 576 x 1 byte in fp8 (a GQA
    # reading of the same config, 2 x 128 heads x 192, is 85x larger)
    assert model.kv_bytes_per_token(1) == 61 * 576
    maverick = preset("llama-4-maverick")  # MoE every other layer, the dense ones twice as wide
    assert maverick.dense_layer_ids == tuple(range(0, 48, 2)) and maverick.intermediate_size == 16384


def test_the_engine_refuses_what_only_the_planner_can_size(tmp_path):
    from shardserve.models.safetensors_files import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"`shardserve plan` can size DeepseekV3ForCausalLM; the engine cannot"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("name", ["Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "llama3.1_70b",
                                  "meta-llama/Llama-3.3-70B-Instruct"])
def test_preset_names_are_forgiving(name):
    assert resolve_model(name) == preset("llama-3.1-70b")


def test_hf_folder_needs_only_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}))
    config = resolve_model(str(tmp_path))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (4, 2, 32)


def test_unknown_model_lists_the_presets():
    with pytest.raises(ConfigError, match="not a preset .*mixtral-8x7b"):
        resolve_model("no-such-model")


def _write(tmp_path, data) -> str:
    path = tmp_path / "eff.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_calibration_file_round_trip(tmp_path):
    path = _write(tmp_path, {"format": CALIBRATION_FORMAT, "source": "profile run 7",
                             "devices": {"H100 SXM": {"gemm": 0.6, "memory": 0.9, "num_samples": 50}}})
    calibration = load_calibration(path)
    eff = calibration.for_device("H100 SXM", ("h100",))
    assert eff.calibrated and eff.gemm == 0.6 and eff.memory == 0.9
    assert eff.attention == Efficiency().attention  # missing factors keep the prior
    assert eff.label == "calibrated (profile run 7)"
    assert not calibration.for_device("H200").calibrated
    assert Efficiency().label == "uncalibrated"


def test_factors_hold_for_the_dtype_they_were_fitted_in(tmp_path):
    path = _write(tmp_path, {"format": CALIBRATION_FORMAT, "source": "fits", "devices": {
        "H100 SXM": {"dtype": "bfloat16", "gemm": 0.6},
        "h100@float8": {"gemm": 0.45},
        "H200": {"memory": 0.9}}})  # no dtype stated: any
    calibration = load_calibration(path)
    assert calibration.for_device("H100 SXM", ("h100",), "bfloat16").gemm == 0.6
    assert calibration.for_device("H100 SXM", ("h100",), "float8").gemm == 0.45
    assert not calibration.for_device("H100 SXM", ("h100",), "float16").calibrated  # fitted in neither
    assert calibration.for_device("H200", (), "float8").memory == 0.9


@pytest.mark.parametrize("data,match", [
    ({"devices": {"h100": {}}}, "format"),
    ({"format": CALIBRATION_FORMAT, "devices": {}}, "non-empty"),
    ({"format": CALIBRATION_FORMAT, "devices": {"h100": {"gemm": 1.5}}}, "gemm must be in"),
    ({"format": CALIBRATION_FORMAT, "devices": {"h100": {"memory": "fast"}}}, "not a number"),
])
def test_bad_calibration_files(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        load_calibration(_write(tmp_path, data))
