"""No tensor is made on the host inside a forward, and no op mixes devices: the whole model runs
on the "meta" device (shapes only, no data) under a mode that refuses a factory call (arange,
zeros, tensor, ...) aimed anywhere but the model's device and any op whose tensors live on two
devices. What passes here cannot meet a device mismatch on a GPU (the bug class a review found
in the expert-parallel forward: an arange and a zeros made on the CPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from shardserve.config import ModelConfig
from shardserve.engine.kv_cache import KVCache
from shardserve.layers.attention.paged_kv import SeqSpan
from shardserve.layers.attention.torch_backend import TorchAttention
from shardserve.layers.experts import route
from shardserve.models.registry import model_class
from shardserve.parallel.expert import ExpertLoadCounter, ExpertParallel
from shardserve.parallel.groups import GroupInfo

_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace}


class DeviceDiscipline(TorchFunctionMode):
    """Refuses factory calls that do not name `device`, and ops over tensors on two devices
    (0-d tensors excepted: a CPU scalar tensor may join a GPU op)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            target = kwargs.get("device")
            if target is None or torch.device(target) != self.device:
                raise AssertionError(f"torch.{func.__name__} makes a tensor on {target or 'the host'} inside the "
                                     f"forward (the model is on {self.device})")
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            raise AssertionError(f"{getattr(func, '__name__', func)} mixes tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
TINY_MOE = dataclasses.replace(TINY, architecture="qwen3_moe", num_experts=4, num_experts_per_token=2,
                               moe_intermediate_size=32, qk_norm=True)


class _Cache:  # the geometry build_metadata reads
    def __init__(self, kv: KVCache, device):
        self.num_blocks, self.block_size, self.dtype = kv.num_blocks, kv.block_size, kv.dtype
        self.num_kv_heads, self.head_dim, self.device = kv.num_kv_heads, kv.head_dim, torch.device(device)


# The MoE forward counts its routed tokens (bincount, .tolist()): data the meta device does not
# have, so it runs on real CPU tensors, where the factory rule alone does the checking.
@pytest.mark.parametrize("config, device", [(TINY, "meta"), (TINY_MOE, "cpu")], ids=["dense", "moe"])
def test_a_whole_forward_stays_on_the_models_device(config, device):
    torch.manual_seed(0)
    attention = TorchAttention()
    with torch.device(device):
        model = model_class(config.architecture)(config, torch.bfloat16, 128, None, attention)
    for param in model.parameters():
        param.data.normal_(std=0.05)
    kv = KVCache.allocate(model.kv_shape, 16, 16, torch.bfloat16, torch.device(device))
    # a decode over a cached prefix, a chunk over an earlier one and a whole prompt: every path
    spans = [SeqSpan(20, 1, [3, 4]), SeqSpan(16, 8, [5, 6]), SeqSpan(0, 12, [7])]
    meta = attention.build_metadata(spans, 1, _Cache(kv, device))  # host-side staging, then moved
    num_tokens = 1 + 8 + 12
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with DeviceDiscipline(device):
        hidden = model(input_ids, positions, kv.layers, meta)
        logits = model.compute_logits(hidden[torch.tensor([0, 8, 20], device=device)])
    assert logits.shape == (3, config.vocab_size) and logits.device.type == device


def test_the_expert_parallel_layer_stays_on_the_models_device():
    """The layer the review caught: dispatch, the experts and the combine over a group of one
    (its collectives pass through). It reads split sizes back to the host, so it runs on real
    tensors here, with the routing tables made for the device the model is built on."""
    torch.manual_seed(0)
    from shardserve.layers.experts import Experts
    from shardserve.layers.linear import Linear

    experts = Experts(4, 32, 16, torch.float32)
    experts.gate_up.data.normal_()
    experts.down.data.normal_()
    router = Linear(32, [4], False, torch.float32)
    router.weight.data.normal_()
    layer = ExpertParallel(GroupInfo(), [[0, 1, 2, 3]])
    x, load = torch.randn(6, 32), ExpertLoadCounter(torch.zeros(4, dtype=torch.long))
    with DeviceDiscipline("cpu"):
        out = layer.forward(x, router, experts, 2, True, load)
    weights, ids = route(router(x), 2, True)
    torch.testing.assert_close(out, experts(x, ids, weights), atol=1e-5, rtol=1e-5)


def test_the_mode_catches_a_host_tensor_in_a_forward():
    with pytest.raises(AssertionError, match="arange makes a tensor on the host"):
        with DeviceDiscipline("meta"):
            torch.arange(4)
    on_meta, on_host = torch.ones(3, device="meta"), torch.ones(3)
    with pytest.raises(AssertionError, match="mixes tensors"):
        with DeviceDiscipline("meta"):
            on_meta + on_host
