"""A tensor-parallel rank loads exactly its slice of each weight and reads little else from the
checkpoint (the model is built for rank r of a tp group without starting any process group:
loading needs only the rank's position)."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from shardserve.config import ParallelConfig
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.decoder import DecoderModel
from shardserve.layers.lazy_tensor import LazyTensor
from shardserve.parallel.groups import GroupInfo, ParallelGroups


def rank_model(path, tp_rank: int, tp_size: int = 2):
    checkpoint = load_checkpoint(str(path))
    groups = ParallelGroups(ParallelConfig(tp_size=tp_size), tp_rank, GroupInfo(tp_rank, tp_size, None, (0, 1)),
                            GroupInfo(), 0, None)
    model = DecoderModel(checkpoint.config, torch.float32, 64, groups)
    read = {"elements": 0}

    def counting(tensors):
        for name, lazy in tensors:
            def reader(dim, start, stop, lazy=lazy):
                out = lazy.reader(dim, start, stop)
                read["elements"] += out.numel()
                return out
            yield name, LazyTensor(lazy.shape, reader)

    model.load_weights(counting(checkpoint.iter_lazy_tensors()))
    return model, read["elements"]


def test_each_rank_holds_its_slice(tiny_checkpoints):
    path = tiny_checkpoints["llama"]  # 4 heads of 16, 2 KV heads, MLP 128, vocab 384
    full = load_file(str(path / "model.safetensors"))
    for rank in (0, 1):
        model, _ = rank_model(path, rank)
        layer = model.layers[0]
        q = full["model.layers.0.self_attn.q_proj.weight"][rank * 32:(rank + 1) * 32]
        k = full["model.layers.0.self_attn.k_proj.weight"][rank * 16:(rank + 1) * 16]
        v = full["model.layers.0.self_attn.v_proj.weight"][rank * 16:(rank + 1) * 16]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
        o = full["model.layers.0.self_attn.o_proj.weight"][:, rank * 32:(rank + 1) * 32]
        assert torch.equal(layer.self_attn.o_proj.weight, o)
        gate = full["model.layers.0.mlp.gate_proj.weight"][rank * 64:(rank + 1) * 64]
        up = full["model.layers.0.mlp.up_proj.weight"][rank * 64:(rank + 1) * 64]
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))
        assert torch.equal(layer.mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, rank * 64:(rank + 1) * 64])
        assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"][rank * 192:(rank + 1) * 192])
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"][rank * 192:(rank + 1) * 192])


def test_a_rank_reads_about_half_the_checkpoint_at_tp2(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    total = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    _, single = rank_model(path, 0, tp_size=1)
    _, rank0 = rank_model(path, 0)
    assert single == total
    assert 0.5 <= rank0 / total < 0.51  # only the norms are read whole


def test_replicated_kv_heads_when_tp_exceeds_them(tiny_checkpoints):
    path = tiny_checkpoints["mistral"]  # 4 heads, 1 KV head
    full = load_file(str(path / "model.safetensors"))
    for rank in (0, 1):
        attn = rank_model(path, rank)[0].layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        k = full["model.layers.0.self_attn.k_proj.weight"]  # the one head, on both ranks
        assert torch.equal(attn.qkv_proj.weight[32:48], k)
