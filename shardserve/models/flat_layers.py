"""The decoder's layer stack as one flat loop over resolved kernels, for the common CPU case.

DecoderLayer.forward walks nine modules a layer, each through nn.Module's call machinery and a
few checks (is the input contiguous, which kernel, does it need an all-reduce) that give the same
answer every step. On 2 cores that bookkeeping cost 2-3 ms of a 15-18 ms batch-1 forward (30 layers,
~300 module calls): as much as the attention and every elementwise kernel together. Here the
answers are taken once, after prepacking, and each layer is a handful of direct kernel calls.

The loop is the same sequence of the same kernels as DecoderLayer.forward (the test compares the
two bit for bit), for the layers it covers: dense MLP, no per-head q/k norm, no tensor
parallelism, packed (or block-quantized) weights and the fused norm. Anything else takes the module path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardserve.layers.block_quant import BlockWeight, ConcatBlockWeight
from shardserve.layers.cpu_kernels import load_add_rms_norm, load_silu_mul
from shardserve.layers.linear import PackedWeight

CpuWeight = PackedWeight | BlockWeight | ConcatBlockWeight  # a weight whose `linear` is a native CPU kernel


@dataclass
class FlatLayer:
    input_norm: torch.Tensor  # the norms' weights
    post_attention_norm: torch.Tensor
    qkv: CpuWeight
    qkv_bias: torch.Tensor | None
    o: CpuWeight
    gate_up_silu: Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up of the gate/up matmul
    down: CpuWeight


class FlatLayers:
    """forward(x, cos_sin, kv_caches, meta) over every layer; build() returns None where the
    model has a layer this loop does not cover."""

    def __init__(self, layers: list[FlatLayer], attention, eps: float, num_heads: int, head_dim: int, scale: float):
        self.layers, self.attention = layers, attention
        self.eps, self.num_heads, self.head_dim, self.scale = eps, num_heads, head_dim, scale
        self.add_rms_norm = load_add_rms_norm().default  # build() found it

    @classmethod
    def build(cls, model) -> "FlatLayers | None":
        from shardserve.models.decoder import MLP  # the decoder imports this module

        if load_add_rms_norm() is None or not model.layers:
            return None
        flat = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP or attn.q_norm is not None or layer.input_layernorm.weight.device.type != "cpu":
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (attn.o_proj.tp.size > 1 or mlp.down_proj.tp.size > 1
                    or any(not isinstance(lin.packed, CpuWeight) for lin in linears)
                    or any(lin.bias is not None for lin in linears[1:])):
                return None
            flat.append(FlatLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                  attn.qkv_proj.packed, attn.qkv_proj.bias, attn.o_proj.packed,
                                  _gate_up_silu(mlp.gate_up_proj.packed), mlp.down_proj.packed))
        first = model.layers[0]
        eps = first.input_layernorm.eps
        attn = first.self_attn
        return cls(flat, model.attention, eps, attn.num_heads, attn.head_dim, attn.scale)

    def forward(self, x: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor], meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the residual stream [T, hidden] (contiguous), updated in place. Returns (x, the last
        layer's MLP output, still to be added), as the module path leaves them."""
        norm, attention, eps = self.add_rms_norm, self.attention, self.eps
        num_tokens = x.shape[0]
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = norm(x, delta, layer.input_norm, eps)
            qkv = layer.qkv.linear(h, layer.qkv_bias).view(num_tokens, -1, self.head_dim)
            out = attention.forward(qkv, cos_sin, kv_cache, meta, self.num_heads, self.scale)
            h = norm(x, layer.o.linear(out.reshape(num_tokens, -1), None), layer.post_attention_norm, eps)
            delta = layer.down.linear(layer.gate_up_silu(h), None)
        return x, delta


def _gate_up_silu(gate_up: CpuWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate/up matmul ending in SwiGLU (fused where the kernel has the epilogue; the same bits
    either way), chosen once for the loop."""
    if gate_up.fuses_silu_mul:
        return gate_up.silu_mul
    silu = load_silu_mul().default
    return lambda h: silu(gate_up.linear(h, None))
