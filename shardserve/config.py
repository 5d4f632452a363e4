"""Frozen configuration dataclasses shared by the engine, planner and simulator.

Each config is resolved once (from a checkpoint, CLI flags or a file) and passed explicitly;
derive variants with `dataclasses.replace`, never by mutation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures[0]` -> our family name. Families share one model implementation.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class ConfigError(ValueError):
    """A configuration or checkpoint that cannot be served; the message says why."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "default" or "llama3" (the variant Llama 3.1+ ships);
    "linear" divides positions by `factor`."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer, independent of where it was loaded from."""

    architecture: str  # family: "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed Hugging Face `config.json`."""
        archs = hf.get("architectures") or []
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(sorted(HF_ARCHITECTURES))
            raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {supported}")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_scaling`.
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind not in ("llama3", "linear"):
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    return RopeScaling(
        kind=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. The pool holds `kv_cache_memory_bytes` when set, otherwise
    `kv_cache_memory_fraction` of the memory free after loading the weights (default: 0.85 of
    free GPU memory, 0.1 of free host memory, since on CPU the pool shares RAM with everything)."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Largest chunk of one prompt per step; smaller values interleave prefill with decodes.
    max_prefill_chunk_tokens: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, resolved. `model` is a path or an embedded model name."""

    model: str = "smollm2"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # defaults to the model's context window
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    show_progress: bool = True


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end of one replica."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # defaults to the --model value
    max_waiting_requests: int = 256  # beyond this many unscheduled requests, answer 429
    log_level: str = "info"
