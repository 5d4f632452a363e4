"""Shared fixtures: tiny random checkpoints written by transformers itself, with a small real
byte-level BPE tokenizer trained here, so nothing is downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (shardserve/layers/gpu_kernels) run in Triton's interpreter on
# the CPU tensors the tests pass; the flag must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def main():\n    return 42\n# numbers 0123456789 and symbols !?.,;:()[]{}\n"
    "Large language models are served on many accelerators with tensor and pipeline parallelism. "
) * 20

TINY_SHAPES = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, max_position_embeddings=512, sliding_window=None),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=1000000.0),
    "llama3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=512, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   tie_word_embeddings=True),
    # head_dim 32 != hidden / heads, as in the real Qwen3 models
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1000000.0),
    # MoE: 8 experts, top 2; intermediate_size is Mixtral's expert width
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, num_local_experts=8,
                    num_experts_per_tok=2),
    # a shared expert, no top-k renormalization, and layer 1 dense (mlp_only_layers)
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    # a smaller Llama with the same vocabulary: a draft model for speculative decoding
    "llama_small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=512),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
}

HF_CLASSES = {  # family -> (model class, config class) in transformers
    "llama": ("LlamaForCausalLM", "LlamaConfig"), "llama3": ("LlamaForCausalLM", "LlamaConfig"),
    "llama_small": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"), "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
}


def write_tokenizer(folder: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


def write_tiny_checkpoint(folder: Path, family: str, seed: int = 0, well_conditioned: bool = False) -> Path:
    """A random-weight checkpoint of `family`'s tiny shape. The default weights (std 0.2) make
    logits far from uniform, and the model chaotic: bfloat16 rounding alone moves its logits by
    5% (llama3) to 50% (qwen3_moe), transformers' own bfloat16 against its float32, so two
    correct bfloat16 implementations disagree as much. `well_conditioned` weights (std 0.02, as
    real models start from, and MoE routers at std 1 so that no top-k choice is a near tie) bring
    that to 0.7%: the checkpoints for comparisons made in bfloat16."""
    import transformers

    shape = dict(TINY_SHAPES[family])
    cls_name, cfg_name = HF_CLASSES[family]
    config = getattr(transformers, cfg_name)(vocab_size=384, bos_token_id=0, eos_token_id=1, **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                std = 0.2 if not well_conditioned else 1.0 if ".gate." in name else 0.02
                p.normal_(0, std)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: write_tiny_checkpoint(root / family, family) for family in TINY_SHAPES}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from shardserve.models.checkpoint import resolve_model_path

    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own SmolLM2 from the embedded GGUF, float32, loaded once for the whole run
    (its GGUF dequantization takes about 20 s on this project's machines)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()
