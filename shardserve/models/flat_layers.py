"""The decoder's layer stack as one flat loop over resolved kernels, for the common CPU case.

DecoderLayer.forward walks nine modules a layer, each through nn.Module's call machinery and a
few checks (is the input contiguous, which kernel, does it need an all-reduce) that give the same
answer every step. On 2 cores that bookkeeping cost 2-3 ms of a 15-18 ms batch-1 forward (30 layers,
~300 module calls): as much as the attention and every elementwise kernel together. Here the
answers are taken once, after prepacking, and each layer is a handful of direct kernel calls.

The loop is the same sequence of the same kernels as DecoderLayer.forward (the test compares the
two bit for bit), for the layers it covers: dense MLP, no per-head q/k norm, no tensor
parallelism, packed (or block-quantized) weights and the fused norm. Anything else takes the module path.

A step of decodes only with the native attention backend goes one step further: the same kernel
calls made from C++ (csrc/decode_stack.cpp), one call for the whole stack. At batch 1 the Python
calls themselves (~3 us each, eight a layer) were ~1 ms of a 4-5 ms step on 2 cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardserve.layers.attention.cpu_backend import CpuAttentionMetadata, CpuNativeAttention
from shardserve.layers.block_quant import BlockWeight, ConcatBlockWeight
from shardserve.layers.cpu_kernels import load_add_rms_norm, load_decode_stack, load_silu_mul
from shardserve.layers.linear import PackedWeight

CpuWeight = PackedWeight | BlockWeight | ConcatBlockWeight  # a weight whose `linear` is a native CPU kernel


@dataclass
class FlatLayer:
    input_norm: torch.Tensor  # the norms' weights
    post_attention_norm: torch.Tensor
    qkv: CpuWeight
    qkv_bias: torch.Tensor | None
    o: CpuWeight
    gate_up: CpuWeight
    gate_up_silu: Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up of the gate/up matmul
    down: CpuWeight


class FlatLayers:
    """forward(x, cos_sin, kv_caches, meta) over every layer; build() returns None where the
    model has a layer this loop does not cover."""

    def __init__(self, layers: list[FlatLayer], attention, eps: float, num_heads: int, head_dim: int, scale: float):
        self.layers, self.attention = layers, attention
        self.eps, self.num_heads, self.head_dim, self.scale = eps, num_heads, head_dim, scale
        self.add_rms_norm = load_add_rms_norm().default  # build() found it
        self.stack = DecodeStack.build(self)

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
                                  attn.qkv_proj.packed, attn.qkv_proj.bias, attn.o_proj.packed, mlp.gate_up_proj.packed,
                                  _gate_up_silu(mlp.gate_up_proj.packed), mlp.down_proj.packed))
        first = model.layers[0]
        eps = first.input_layernorm.eps
        attn = first.self_attn
        return cls(flat, model.attention, eps, attn.num_heads, attn.head_dim, attn.scale)

    def forward(self, x: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor], meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the residual stream [T, hidden] (contiguous), updated in place. Returns (x, the last
        layer's MLP output, still to be added), as the module path leaves them."""
        num_tokens = x.shape[0]
        if self.stack is not None and self.stack.covers(meta, num_tokens):
            return self.stack.forward(x, cos_sin, kv_caches, meta)
        norm, attention, eps = self.add_rms_norm, self.attention, self.eps
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


class DecodeStack:
    """FlatLayers.forward for a step of decodes only, in one native call (csrc/decode_stack.cpp):
    the same kernels with the same arguments, so the same bits. build() returns None where the
    attention backend or a weight is not one the native stack calls."""

    LINEAR_BLOCK, LINEAR_PANEL, LINEAR_PANEL_SILU_MUL = 0, 1, 2  # the kinds the C++ side knows

    def __init__(self, kernel, tensors: list[torch.Tensor], ints: list[int], qkv_biases: list[torch.Tensor | None],
                 flat: FlatLayers):
        self.kernel, self.tensors, self.ints, self.qkv_biases = kernel, tensors, ints, qkv_biases
        self.num_heads, self.head_dim, self.scale, self.eps = flat.num_heads, flat.head_dim, flat.scale, flat.eps

    @classmethod
    def build(cls, flat: FlatLayers) -> "DecodeStack | None":
        kernel = load_decode_stack()
        if kernel is None or not isinstance(flat.attention, CpuNativeAttention) or flat.attention.rotary_kv is None:
            return None
        tensors, ints, biases = [], [], []
        for layer in flat.layers:
            specs = [cls._spec(layer.qkv), cls._spec(layer.o), cls._spec(layer.gate_up, gate_up=True),
                     cls._spec(layer.down)]
            if any(spec is None for spec in specs):
                return None
            tensors += [layer.input_norm, layer.post_attention_norm, layer.qkv.data, layer.o.data,
                        layer.gate_up.data, layer.down.data]
            ints += [value for spec in specs for value in spec]
            biases.append(layer.qkv_bias)
        return cls(kernel.default, tensors, ints, biases, flat)

    @classmethod
    def _spec(cls, weight: CpuWeight, gate_up: bool = False) -> tuple[int, int, int] | None:
        """(kind, format, out features) of a weight for the C++ side; None: a kernel it does not call."""
        if isinstance(weight, BlockWeight):
            return cls.LINEAR_BLOCK, weight.format, weight.out_features
        if isinstance(weight, PackedWeight) and weight.panel_kernel is not None:
            fused = gate_up and weight.fuses_silu_mul
            return cls.LINEAR_PANEL_SILU_MUL if fused else cls.LINEAR_PANEL, 0, weight.out_features
        return None

    @staticmethod
    def covers(meta, num_tokens: int) -> bool:
        """Whether a step is decodes only (each row one sequence's next token)."""
        return (isinstance(meta, CpuAttentionMetadata) and meta.num_decodes == num_tokens
                and meta.prefill_tables is None and not meta.prefills)

    def forward(self, x: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor], meta: CpuAttentionMetadata):
        x, delta = self.kernel(x, self.tensors, self.ints, self.qkv_biases, kv_caches, *cos_sin, meta.slot_mapping,
                               meta.block_table, meta.context_lens, self.num_heads, self.head_dim, self.scale, self.eps)
        return x, delta
