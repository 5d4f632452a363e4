"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2): one implementation, shape-driven.

Tokens of all sequences in a step are packed along one axis (`T`), so every matmul sees the whole
batch; only attention looks at sequence boundaries, through `AttentionMetadata`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.layers.activation import silu_and_mul
from shardserve.layers.attention import AttentionMetadata, paged_attention
from shardserve.layers.linear import Linear, default_weight_loader, packed_linear, prepack_weight
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding, apply_rotary

# checkpoint sub-name -> (our fused parameter sub-name, shard index)
FUSED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, [q_size, kv_size, kv_size], config.attention_bias, dtype)
        self.o_proj = Linear(q_size, [config.hidden_size], False, dtype)
        self.scale = self.head_dim**-0.5

    def forward(self, cos_sin, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 KV, D]
        # rotate queries and keys in one pass: they are adjacent heads of the fused projection
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [size, size], False, dtype)
        self.down_proj = Linear(size, [config.hidden_size], False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, cos_sin, x, delta, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden], updated in place; delta: the previous layer's MLP
        output, still to be added (None for the first layer). Returns (x, this layer's MLP output):
        each residual add is folded into the norm that follows it."""
        h = self.input_layernorm(x, delta)
        h = self.post_attention_layernorm(x, self.self_attn(cos_sin, h, kv_cache, meta))
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> final hidden states [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None
        self.packed_lm_head: torch.Tensor | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rotary.lookup(positions)
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta = layer(cos_sin, x, delta, kv_cache, meta)
        return self.norm(x, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return packed_linear(hidden, self.packed_lm_head, None).float()
        return torch.nn.functional.linear(hidden, self._lm_head_weight()).float()

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def prepack(self) -> None:
        """Repack matmul weights for the device's fastest kernels; call once, after loading.
        A tied head keeps the embedding as is (lookups need it) and packs a copy."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        self.packed_lm_head = prepack_weight(self._lm_head_weight())
        if self.packed_lm_head is not None and self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors:
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight":
                if self.lm_head is None:
                    continue  # tied: the embedding serves as the head
                name = "lm_head"
            if "rotary_emb" in name:
                continue
            shard_id = None
            for ckpt_part, (fused_part, shard) in FUSED_WEIGHTS.items():
                if f".{ckpt_part}." in name:
                    name, shard_id = name.replace(ckpt_part, fused_part), shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                loader(param, tensor.to(param.dtype), shard_id)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
