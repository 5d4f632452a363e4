"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2, and with MoE layers from moe.py:
Mixtral, Qwen2-MoE, Qwen3-MoE): one implementation, shape-driven.

Tokens of all sequences in a step are packed along one axis (`T`), so every matmul sees the whole
batch; only attention looks at sequence boundaries, through its backend's per-step metadata
(layers/attention/). Which kernels run is the backend's choice, made by the loader, not here.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.layers.activation import silu_and_mul
from shardserve.layers.attention.backend import AttentionBackend
from shardserve.layers.attention.paged_kv import KVShape
from shardserve.layers.attention.torch_backend import TorchAttention
from shardserve.layers.block_quant import BlockWeight, ConcatBlockWeight, kernels_available
from shardserve.layers.huge_pages import move_to_huge_pages
from shardserve.layers.lazy_tensor import LazyTensor, as_lazy
from shardserve.layers.linear import Linear, PackedWeight, default_weight_loader
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.models.flat_layers import FlatLayers
from shardserve.models.moe import SparseMoeBlock, expert_param_name
from shardserve.models.weight_names import WEIGHT_NAMES
from shardserve.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.parallel.groups import GroupInfo, ParallelGroups
from shardserve.parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them with tp=1); the backend rotates,
    stores this step's keys and values, and attends."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: GroupInfo, backend: AttentionBackend):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_heads, config.num_kv_heads, self.head_dim,
                                          config.attention_bias, dtype, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_local_heads, self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, False, dtype, tp)
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, cos_sin, x, kv_cache, meta) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 KV, D]
        if self.q_norm is not None:  # Qwen3: normalize each query and key head over D, before rotary
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            qkv = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v), dim=1)
        out = self.backend.forward(qkv, cos_sin, kv_cache, meta, self.num_heads, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU MLP; with tp > 1 each rank holds a slice of the intermediate features."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: GroupInfo, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], False, dtype, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up_proj.packed
        if packed is not None and packed.fuses_silu_mul and x.dim() == 2:
            return self.down_proj(packed.silu_mul(x))  # the same bits, one pass fewer
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def build_mlp(config: ModelConfig, dtype: torch.dtype, layer_id: int, groups: ParallelGroups) -> nn.Module:
    """The dense MLP, or for a sparse layer of an MoE model the MoE block (with its shared expert
    when the model has one)."""
    if not config.is_moe_layer(layer_id):
        return MLP(config, dtype, groups.tp)
    shared_size = config.shared_expert_intermediate_size
    return SparseMoeBlock(config, dtype, MLP(config, dtype, groups.tp, shared_size) if shared_size else None, groups)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_id: int, groups: ParallelGroups,
                 attention: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, groups.tp, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = build_mlp(config, dtype, layer_id, groups)

    def forward(self, cos_sin, x, delta, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden], updated in place; delta: the previous layer's MLP
        output, still to be added (None for the first layer). Returns (x, this layer's MLP output):
        each residual add is folded into the norm that follows it."""
        h = self.input_layernorm(x, delta)
        h = self.post_attention_layernorm(x, self.self_attn(cos_sin, h, kv_cache, meta))
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> final hidden states [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] float32; compute_greedy(hidden) -> their
    argmax [N] int64, or None where only compute_logits can answer (tp).

    In a parallel replica each rank builds only its part: its pipeline stage's layers (the
    embedding on the first stage, the final norm and head on the last), each layer's tp slice.
    A stage after the first takes the previous stage's residual stream as `hidden_in`; a stage
    before the last returns its residual stream instead of normed hidden states."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_positions: int,
                 groups: ParallelGroups | None = None, attention: AttentionBackend | None = None):
        super().__init__()
        groups = groups or ParallelGroups.single()
        self.config = config
        self.attention = attention or TorchAttention()  # the loader passes the device's backend
        self.weight_names = WEIGHT_NAMES[config.architecture]
        self.layer_ids = groups.config.model_stages(config)[groups.pp_rank]
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, dtype)
        self.embed_tokens = self.norm = self.lm_head = None
        if groups.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, groups.tp)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, layer_id, groups, self.attention)
                                    for layer_id in self.layer_ids)
        if groups.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, groups.tp)
        self.flat_layers: FlatLayers | None = None  # set by prepack() where it covers every layer

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden_in is None else hidden_in  # [T, hidden]
        cos_sin = self.rotary.lookup(positions)
        delta = None
        if self.flat_layers is not None and x.is_contiguous():
            x, delta = self.flat_layers.forward(x, cos_sin, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, delta = layer(cos_sin, x, delta, kv_cache, meta)
        if self.norm is None:  # not the last stage: pass the residual stream on
            return x if delta is None else x.add_(delta)
        return self.norm(x, delta)

    @property
    def kv_shape(self) -> KVShape:
        attn = self.layers[0].self_attn
        return KVShape(len(self.layers), attn.num_kv_heads, attn.head_dim)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.greedy_tokens(hidden)

    def keep_checkpoint_blocks(self) -> None:
        """`--quantization gguf`: the linears, the LM head and the embedding take a GGUF tensor's
        blocks as they are where the kernels have its format (layers/block_quant.py); call before
        load_weights. Other tensors (norms, MoE experts, other formats) load as usual, and all of
        them where the native kernels are missing (no compiler: a warning says so)."""
        if not kernels_available():
            log.warning("--quantization gguf: no native CPU kernels, so the GGUF's blocks are dequantized")
            return
        for module in self.modules():
            if isinstance(module, (Linear, VocabParallelEmbedding)):
                module.keep_blocks = True

    def prepack(self, quantization: str | None = None) -> None:
        """Repack matmul weights for the device's fastest kernels, the layers' linear weights in
        `quantization` where one is given (the LM head stays as it is, or in its blocks with
        "gguf"); call once, after loading."""
        for module in self.modules():
            if isinstance(module, ParallelLMHead):
                module.prepack()
            elif isinstance(module, Linear):
                module.prepack(quantization)
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.embed_tokens.share_rows_of(self.lm_head.packed)
        streamed = {id(w): w for m in self.modules() for w in _streamed_weights(getattr(m, "packed", None))}
        move_to_huge_pages(list(streamed.values()))  # before FlatLayers takes the tensors
        self.flat_layers = FlatLayers.build(self)

    def weight_bytes_per_param(self) -> float | None:
        """Bytes per parameter of the linears and the LM head as this rank keeps them, what a step
        reads of each (GGUF blocks: 0.56-1.06), where some are quantized; None where all keep the
        model's dtype. The byte counts of the efficiency metrics and the profiler (planner
        Deployment.weight_bytes_per_param)."""
        parts = [part for m in self.modules() if isinstance(m, (Linear, ParallelLMHead))
                 for part in _parts(m.packed or m.weight)]
        if all(isinstance(p, (torch.Tensor, PackedWeight)) for p in parts):
            return None
        kept = [_kept(p) for p in parts]
        return sum(b for b, _ in kept) / sum(n for _, n in kept)

    def load_weights(self, tensors: Iterable[tuple[str, "torch.Tensor | LazyTensor"]]) -> None:
        """Copy checkpoint tensors (HF names) into our parameters, each rank reading only its
        part (other stages' layers are skipped); every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in tensors:
            for name, shard_id in self._param_names(ckpt_name):
                if name not in params:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                with torch.no_grad():
                    loader(param, as_lazy(tensor), shard_id)
                loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _param_names(self, name: str) -> list[tuple[str, object]]:
        """Checkpoint name -> [(our parameter name, shard id)] on this rank (none: not ours)."""
        name = self.weight_names.canonical(name)
        if name is None:
            return []
        if name == "embed_tokens.weight":
            tied = self.config.tie_word_embeddings and self.lm_head is not None
            return [(n, None) for n, ours in (("embed_tokens.weight", self.embed_tokens is not None),
                                              ("lm_head.weight", tied)) if ours]
        if name in ("lm_head.weight", "norm.weight"):
            keep = self.lm_head is not None and not (name == "lm_head.weight" and self.config.tie_word_embeddings)
            return [(name, None)] if keep else []
        parts = name.split(".")
        if parts[0] == "layers":
            layer_id = int(parts[1])
            if layer_id not in self.layer_ids:
                return []
            parts[1] = str(layer_id - self.layer_ids.start)
            name = ".".join(parts)
        expert = expert_param_name(name)
        if expert is not None:  # routed experts: stacked parameters, shard_id = (expert_id, shard)
            return [expert]
        return [self.weight_names.unfuse(name)]


def _parts(weight) -> list:
    """What a weight is kept as, piece by piece: a ConcatBlockWeight's parts, else the weight."""
    return weight.parts if isinstance(weight, ConcatBlockWeight) else [weight]


def _streamed_weights(packed) -> list:
    """The CPU weights a decode step reads whole, whose `data` our kernels take (layers/huge_pages.py)."""
    return [p for p in _parts(packed)
            if (isinstance(p, BlockWeight) or (isinstance(p, PackedWeight) and p.panel_kernel is not None))
            and p.data.device.type == "cpu" and p.data.is_contiguous()]


def _kept(weight) -> tuple[int, int]:
    """(bytes, parameters) of a weight as kept: a tensor, or a packed form holding `data`."""
    if isinstance(weight, torch.Tensor):
        return weight.nbytes, weight.numel()
    return weight.data.nbytes, weight.out_features * weight.in_features
