"""Model shapes (dense and MoE) and parallel layouts, as the planner's cost model sees them."""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only transformer. Dense when num_experts == 0;
    otherwise every layer's MLP is `num_experts` routed experts (top `num_experts_per_token`) of
    width `expert_intermediate_size`, plus `num_shared_experts` always-on experts of that width."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        dims = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
        for name in dims:
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        top_k_ok = 0 < self.num_experts_per_token <= self.num_experts
        if self.is_moe and not (top_k_ok and self.expert_intermediate_size > 0):
            raise ConfigError("an MoE shape needs 0 < num_experts_per_token <= num_experts "
                              "and expert_intermediate_size > 0")
        if not self.is_moe and self.intermediate_size <= 0:
            raise ConfigError("a dense shape needs intermediate_size > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "ModelShape":
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings)

    @classmethod
    def llama31_70b(cls) -> "ModelShape":
        return cls(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, vocab_size=128256)

    @classmethod
    def mixtral_8x7b(cls) -> "ModelShape":
        return cls(hidden_size=4096, intermediate_size=0, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, vocab_size=32000, num_experts=8, num_experts_per_token=2,
                   expert_intermediate_size=14336)

    @property
    def attention_params_per_layer(self) -> int:
        """q and o: hidden x heads*head_dim each; k and v: hidden x kv_heads*head_dim each."""
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def expert_params(self) -> int:
        """One gated expert (gate, up, down): 3 x hidden x expert_intermediate."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def mlp_params_per_layer(self) -> int:
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        router = self.hidden_size * self.num_experts
        return router + (self.num_experts + self.num_shared_experts) * self.expert_params

    @property
    def num_params(self) -> int:
        """All parameters (tied embedding counted once); equals ModelConfig.num_params when dense."""
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches: only its top-k routed experts (plus shared ones)."""
        if not self.is_moe:
            return self.num_params
        idle = (self.num_experts - self.num_experts_per_token) * self.expert_params
        return self.num_params - self.num_layers * idle


@dataclass(frozen=True)
class Parallelism:
    """tp ranks per pipeline stage, pp stages, experts split into ep groups over a stage's ranks."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Parallelism.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def validate_layout(shape: ModelShape, par: Parallelism) -> None:
    """Raise ConfigError unless `par` can shard `shape` (see the module docstring for the layout)."""
    if shape.num_heads % par.tp:
        raise ConfigError(f"tp={par.tp} does not divide num_heads={shape.num_heads}")
    kv = shape.num_kv_heads
    if (par.tp <= kv and kv % par.tp) or (par.tp > kv and par.tp % kv):
        raise ConfigError(f"tp={par.tp} cannot split or evenly replicate num_kv_heads={kv}")
    if par.pp > shape.num_layers:
        raise ConfigError(f"pp={par.pp} exceeds num_layers={shape.num_layers}")
    if par.ep > 1 and not shape.is_moe:
        raise ConfigError(f"ep={par.ep} needs an MoE model (this shape is dense)")
    if shape.is_moe and shape.num_experts % par.ep:
        raise ConfigError(f"ep={par.ep} does not divide num_experts={shape.num_experts}")
    if par.tp % par.ep:
        raise ConfigError(f"ep={par.ep} must divide tp={par.tp}: expert groups live inside a stage's tp ranks")
    if shape.is_moe and shape.expert_intermediate_size % (par.tp // par.ep):
        raise ConfigError(f"tp/ep={par.tp // par.ep} does not divide expert_intermediate_size")
