"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) and dense Qwen3: their configs, the
routing and expert math on their own, and checkpoint names. Parity with transformers for these
families runs with the others' in test_decoder.py."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from shardserve.config import ModelConfig
from shardserve.layers.experts import Experts
from shardserve.layers.experts import route
from shardserve.models.moe import expert_param_name

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3"]


def test_config_reads_moe_fields(tiny_checkpoints):
    def config(family):
        return ModelConfig.from_hf_config(json.loads((tiny_checkpoints[family] / "config.json").read_text()))

    mixtral, qwen2_moe, qwen3_moe, qwen3 = (config(f) for f in FAMILIES)
    assert (mixtral.num_experts, mixtral.num_experts_per_token, mixtral.moe_intermediate_size) == (8, 2, 32)
    assert mixtral.norm_topk_prob and not mixtral.qk_norm and not mixtral.attention_bias
    assert (qwen2_moe.shared_expert_intermediate_size, qwen2_moe.dense_layer_ids) == (48, (1,))
    assert not qwen2_moe.norm_topk_prob and qwen2_moe.attention_bias
    assert [qwen2_moe.is_moe_layer(i) for i in range(2)] == [True, False]
    assert (qwen3_moe.num_experts, qwen3_moe.moe_intermediate_size) == (8, 48)
    assert qwen3_moe.shared_expert_intermediate_size == 0 and qwen3_moe.dense_layer_ids == ()
    assert qwen3_moe.qk_norm and qwen3_moe.norm_topk_prob
    assert qwen3.qk_norm and not qwen3.is_moe and qwen3.head_dim == 32


def test_num_params_counts_every_expert(tiny_checkpoints):
    for family in ("mixtral", "qwen3_moe", "qwen3"):  # no attention biases, which num_params leaves out
        hf = json.loads((tiny_checkpoints[family] / "config.json").read_text())
        ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family])
        assert ModelConfig.from_hf_config(hf).num_params == sum(p.numel() for p in ref.parameters()), family


def test_decoder_sparse_step_and_mlp_only_layers():
    hf = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
              num_hidden_layers=6, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=4, decoder_sparse_step=2, mlp_only_layers=[3])
    # sparse where (i + 1) % 2 == 0, i.e. 1, 3, 5; then 3 is forced dense
    assert ModelConfig.from_hf_config(hf).dense_layer_ids == (0, 2, 3, 4)


def test_route_renormalizes_top_k_only_when_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]])
    probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
    weights, ids = route(logits, 2, normalize=False)
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(weights, torch.stack([probs[0, [3, 2]], probs[1, [0, 3]]]))
    weights, ids = route(logits.bfloat16(), 2, normalize=True)
    assert weights.dtype == torch.float32 and ids.tolist() == [[3, 2], [0, 3]]
    e = torch.e
    # renormalized: p_i / (p_i + p_j) = 1 / (1 + exp(l_j - l_i))
    expected = torch.tensor([[e / (e + 1), 1 / (e + 1)], [e**2 / (e**2 + 1), 1 / (e**2 + 1)]])
    torch.testing.assert_close(weights, expected)


def random_experts(num_experts=4, hidden=8, width=6, local_expert_ids=None, seed=0):
    experts = Experts(num_experts, hidden, width, torch.float32, local_expert_ids)
    torch.manual_seed(seed)
    gate_up, down = torch.randn(num_experts, 2 * width, hidden), torch.randn(num_experts, hidden, width)
    experts.gate_up.weight_loader(experts.gate_up, gate_up, (None, None))  # the stacked layout
    experts.down.weight_loader(experts.down, down, (None, None))
    return experts, gate_up, down


def expert_reference(x, gate_up, down, topk_ids, topk_weights, expert_ids):
    """sum over each token's chosen experts that are in `expert_ids`, token by token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t]):
            if e in expert_ids:
                gate, up = F.linear(x[t], gate_up[e]).chunk(2)
                out[t] += w * F.linear(F.silu(gate) * up, down[e])
    return out


def test_experts_match_per_token_reference_and_skip_experts_not_held():
    x = torch.randn(10, 8)
    topk_weights, topk_ids = route(torch.randn(10, 4), 2, normalize=True)
    full, gate_up, down = random_experts()
    expected = expert_reference(x, gate_up, down, topk_ids, topk_weights, {0, 1, 2, 3})
    torch.testing.assert_close(full(x, topk_ids, topk_weights), expected)
    # a rank holding experts 3 and 1 only (slots in that order): the others contribute zero
    part, _, _ = random_experts(local_expert_ids=[3, 1])
    assert part.gate_up.shape[0] == 2 and part.local_slots == {3: 0, 1: 1}
    torch.testing.assert_close(part.gate_up[0], gate_up[3])
    expected = expert_reference(x, gate_up, down, topk_ids, topk_weights, {1, 3})
    torch.testing.assert_close(part(x, topk_ids, topk_weights), expected)


def test_per_expert_tensors_load_like_stacked_ones():
    stacked, gate_up, down = random_experts(local_expert_ids=[2, 0])
    per_expert = Experts(4, 8, 6, torch.float32, [2, 0])
    for e in range(4):  # the checkpoint has all experts; only 2 and 0 are kept
        gate, up = gate_up[e].chunk(2)
        per_expert.gate_up.weight_loader(per_expert.gate_up, gate, (e, 0))
        per_expert.gate_up.weight_loader(per_expert.gate_up, up, (e, 1))
        per_expert.down.weight_loader(per_expert.down, down[e], (e, None))
    torch.testing.assert_close(per_expert.gate_up, stacked.gate_up)
    torch.testing.assert_close(per_expert.down, stacked.down)


@pytest.mark.parametrize("name, expected", [
    ("layers.0.mlp.experts.7.w1.weight", ("layers.0.mlp.experts.gate_up", (7, 0))),  # Mixtral
    ("layers.0.mlp.experts.7.w3.weight", ("layers.0.mlp.experts.gate_up", (7, 1))),
    ("layers.0.mlp.experts.7.w2.weight", ("layers.0.mlp.experts.down", (7, None))),
    ("layers.1.mlp.experts.12.up_proj.weight", ("layers.1.mlp.experts.gate_up", (12, 1))),  # Qwen
    ("layers.1.mlp.experts.12.down_proj.weight", ("layers.1.mlp.experts.down", (12, None))),
    ("layers.1.mlp.experts.gate_up_proj", ("layers.1.mlp.experts.gate_up", (None, None))),  # stacked
    ("layers.1.mlp.experts.down_proj", ("layers.1.mlp.experts.down", (None, None))),
    ("layers.1.mlp.shared_expert.gate_proj.weight", None),
    ("layers.1.mlp.gate.weight", None),
])
def test_expert_checkpoint_names(name, expected):
    assert expert_param_name(name) == expected
