"""Named model shapes for the planner, and resolving `--model` to a ModelConfig.

A preset is the public `config.json` of a released checkpoint (the fields that shape compute and
memory), parsed by the same `ModelConfig.from_hf_config` that reads real checkpoints, so a plan
for "llama-3.1-70b" and one for a downloaded Llama-3.1-70B folder see the same shape.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardserve.config import ConfigError, ModelConfig

_LLAMA31_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}

_LLAMA4_TEXT_COMMON: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "num_experts_per_tok": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
}

# name -> config.json fields (meta-llama/Llama-3.1-8B, -70B, -405B, mistralai/Mixtral-8x7B-v0.1, -8x22B-v0.1,
# Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3 (R1 shares its shape),
# meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E on the Hugging Face hub; the shape fields
# only: Llama 4's vision tower and DeepSeek's multi-token-prediction layer are left out).
_PRESET_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {**_LLAMA31_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3.1-70b": {**_LLAMA31_COMMON, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3.1-405b": {**_LLAMA31_COMMON, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                       "num_attention_heads": 128, "num_key_value_heads": 8},
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
        "num_local_experts": 8, "num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 2,
    },
    "mixtral-8x22b": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32768, "hidden_size": 6144,
        "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
        "num_local_experts": 8, "num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    },
    "llama-4-scout": {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {
        **_LLAMA4_TEXT_COMMON, "num_local_experts": 16, "interleave_moe_layer_step": 1,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192}, "max_position_embeddings": 10485760}},
    "llama-4-maverick": {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {
        **_LLAMA4_TEXT_COMMON, "num_local_experts": 128, "interleave_moe_layer_step": 2,
        "max_position_embeddings": 1048576}},
}
# checkpoints that share a preset's shape
_ALIASES = {"deepseek-r1": "deepseek-v3", "deepseek-r1-0528": "deepseek-v3", "llama-3.3-70b": "llama-3.1-70b",
            "llama-4-scout-17b-16e": "llama-4-scout", "llama-4-maverick-17b-128e": "llama-4-maverick"}


def _normalize(name: str) -> str:
    # "Llama-3.1-70B", "llama3.1-70b" and "meta-llama/Llama-3.1-70B-Instruct" name one shape:
    # drop an org prefix, an -Instruct / -v0.1 suffix, case and separators.
    base = name.strip().rsplit("/", 1)[-1].lower()
    base = re.sub(r"-v\d+(\.\d+)*$", "", base)
    base = re.sub(r"-(instruct|chat|base)$", "", base)
    base = re.sub(r"-v\d+(\.\d+)*$", "", base)
    return re.sub(r"[^a-z0-9.]", "", base)


def preset_names() -> list[str]:
    return sorted(_PRESET_HF_CONFIGS)


def preset(name: str) -> ModelConfig | None:
    """The preset `name` names (ignoring case, separators, an org prefix and -Instruct), or None."""
    wanted = _normalize(name)
    wanted = next((_normalize(target) for alias, target in _ALIASES.items() if _normalize(alias) == wanted), wanted)
    for key, hf in _PRESET_HF_CONFIGS.items():
        if _normalize(key) == wanted:
            return ModelConfig.from_hf_config(hf, shapes_only=True)
    return None


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset name; an HF folder (only its config.json is read, so a plan needs no weights); or
    anything else `load_checkpoint` accepts (.gguf file, embedded model name). ConfigError names
    the presets when nothing matches."""
    found = preset(name_or_path)
    if found is not None:
        return found
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        from shardserve.models.safetensors_files import read_hf_config

        return read_hf_config(path, shapes_only=True)
    from shardserve.models.checkpoint import EMBEDDED_MODELS, load_checkpoint  # imports torch: only when needed

    if name_or_path.lower() not in EMBEDDED_MODELS and not path.exists():
        raise ConfigError(f"unknown model {name_or_path!r}: not a preset ({', '.join(preset_names())}) "
                          "and no such file or folder")
    return load_checkpoint(name_or_path).config
