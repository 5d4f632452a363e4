"""Cost model: hand-computed FLOPs, bytes, collectives, memory fit and roofline behaviour, for the
engine's layout (ParallelConfig: stage = max(tp, ep) ranks, experts over the whole stage)."""
from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import pytest

from shardserve.config import ConfigError, EngineConfig, MlaShape, ModelConfig, ParallelConfig
from shardserve.planner.collectives import (
    all_gather_time_s, all_to_all_time_s, p2p_time_s, ring_allreduce_time_s,
)
from shardserve.param_counts import kv_values_per_token, o_params, qkv_params
from shardserve.planner.batch_load import BatchSummary, num_attended_pairs
from shardserve.planner.cost_model import (
    Deployment, attention_flops_per_pair, decode_step_time, fraction_of_experts_hit, layer_flops, prefill_time,
    step_time, step_work,
)
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.expert_load import busiest_rank_rows
from shardserve.planner.hardware import get_hardware
from shardserve.planner.memory_fit import (
    kv_bytes_per_token, kv_bytes_per_token_per_rank, max_batch_tokens, max_num_seqs_that_fit, weight_bytes_per_rank,
)
from shardserve.planner.model_presets import preset

# h=64, I=128, 4 heads of 16, 2 kv heads, 2 layers, vocab 384.
TINY = ModelConfig(architecture="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
# Same attention; MLP = 4 experts of width 32, top-2 (an expert is 3*64*32 = 6144 params).
TINY_MOE = dataclasses.replace(TINY, architecture="mixtral", intermediate_size=32, num_experts=4,
                               num_experts_per_token=2, moe_intermediate_size=32)
LLAMA70B = preset("llama-3.1-70b")
MIXTRAL = preset("mixtral-8x7b")
QWEN3_MOE = preset("qwen3-30b-a3b")
BF16 = 2
H100_BW = 0.8 * 3.35e12  # memory bandwidth after the default efficiency
H100_PEAK = 0.6 * 989.4e12  # bf16 GEMM FLOP/s after the default efficiency
NVLINK = (450e9 * 0.7, 1e-6)


def par(tp: int = 1, pp: int = 1, ep: int = 1, **kw) -> ParallelConfig:
    return ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, **kw)


def dep(model: ModelConfig, parallel: ParallelConfig, hw: str = "h100", **kw) -> Deployment:
    return Deployment(model, parallel, get_hardware(hw), **kw)


def test_layer_flops_prefill_by_hand():
    f = layer_flops(TINY, num_tokens=8, context_len=8)
    assert f.qkv_flops == 2 * 8 * 64 * 16 * (4 + 2 * 2) == 131_072
    assert f.o_flops == 2 * 8 * (4 * 16) * 64 == 65_536
    assert f.mlp_flops == 2 * 8 * 3 * 64 * 128 == 393_216
    assert f.router_flops == 0
    # causal: token i sees i+1 keys -> 1+2+...+8 = 36 pairs; 4 FLOPs per pair per head-dim (QK^T + PV)
    assert f.attention_flops == 4 * 4 * 16 * 36 == 9_216
    assert f.total_flops == 131_072 + 65_536 + 393_216 + 9_216


def test_attention_pairs_decode_and_chunk():
    assert num_attended_pairs(1, 10) == 10  # decode: all 10 keys
    assert layer_flops(TINY, 1, 10).attention_flops == 4 * 1 * 10 * 4 * 16
    assert num_attended_pairs(4, 10) == 4 * 6 + (1 + 2 + 3 + 4)  # chunk after 6 cached tokens
    with pytest.raises(ConfigError):
        num_attended_pairs(5, 4)


def test_moe_flops_count_only_active_experts():
    moe = layer_flops(TINY_MOE, num_tokens=8, context_len=8)
    # top-2 experts of width 32 cost the same as a dense MLP of width 2 * 32
    dense_equivalent = layer_flops(dataclasses.replace(TINY, intermediate_size=64), 8, 8)
    assert moe.mlp_flops == dense_equivalent.mlp_flops == 2 * 8 * 2 * 3 * 64 * 32
    assert moe.router_flops == 2 * 8 * 64 * 4
    assert moe.qkv_flops == dense_equivalent.qkv_flops
    # Qwen2-MoE style shared expert of width 32, with its 64 -> 1 sigmoid gate
    shared = layer_flops(dataclasses.replace(TINY_MOE, architecture="qwen2_moe",
                                             shared_expert_intermediate_size=32), 8, 8)
    assert shared.mlp_flops == 2 * 8 * (2 * 3 * 64 * 32 + 3 * 64 * 32 + 64)
    # a layer listed in dense_layer_ids keeps a dense MLP of intermediate_size
    first_dense = dataclasses.replace(TINY_MOE, dense_layer_ids=(0,))
    assert layer_flops(first_dense, 8, 8, layer_id=0).mlp_flops == 2 * 8 * 3 * 64 * 32
    assert layer_flops(first_dense, 8, 8, layer_id=0).router_flops == 0


def test_preset_param_counts_match_published_sizes():
    # Mixtral per layer: attention 4096*128*(2*32 + 2*8) + 8 experts * 3*4096*14336 + router 4096*8 + norms
    per_layer = 41_943_040 + 1_409_286_144 + 32_768 + 8_192
    assert MIXTRAL.num_params == 32 * per_layer + 2 * 32_000 * 4096 + 4096 == 46_702_792_704
    assert layer_flops(MIXTRAL, 1, 1).mlp_flops == 2 * 2 * 3 * 4096 * 14336  # 2 of 8 experts
    assert LLAMA70B.num_params == 70_553_706_496  # "70B"
    assert 30.0e9 < QWEN3_MOE.num_params < 30.7e9  # "30B", 128 experts of width 768, 48 layers


@pytest.mark.parametrize("model", [TINY, dataclasses.replace(TINY, tie_word_embeddings=True), TINY_MOE,
                                   LLAMA70B, MIXTRAL, QWEN3_MOE])
def test_one_rank_holds_every_parameter(model):
    assert weight_bytes_per_rank(model, par(), 1) == model.num_params


def test_kv_bytes_per_token_gqa_and_moe():
    assert kv_bytes_per_token(LLAMA70B, BF16) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token(MIXTRAL, BF16) == 2 * 32 * 8 * 128 * 2 == 131_072  # experts don't add KV
    assert kv_bytes_per_token(QWEN3_MOE, BF16) == 2 * 48 * 4 * 128 * 2 == 98_304
    assert kv_bytes_per_token_per_rank(LLAMA70B, par(tp=8), BF16) == 327_680 // 8
    # tp=16 > 8 kv heads: each rank keeps one replicated head, so no further saving
    assert kv_bytes_per_token_per_rank(LLAMA70B, par(tp=16), BF16) == 327_680 // 8
    # pp=3: the engine's balanced split gives 27, 27, 26 layers
    assert kv_bytes_per_token_per_rank(LLAMA70B, par(tp=8, pp=3), BF16) == 2 * 27 * 1 * 128 * 2
    # ep does not split attention: tp=2, ep=8 keeps 4 of Mixtral's 8 kv heads on every rank
    assert kv_bytes_per_token_per_rank(MIXTRAL, par(tp=2, ep=8), BF16) == 2 * 32 * 4 * 128 * 2


def test_weight_bytes_per_rank_by_hand():
    # tp=2: q,o 2*64*64/2 = 4096; k,v 2*64*16*1 = 2048; mlp 3*64*128/2 = 12288; norms 128 -> 18560/layer
    # 2 layers = 37120; embedding + head 2 * 192*64 = 24576; final norm 64 -> 61760 params
    assert weight_bytes_per_rank(TINY, par(tp=2), BF16) == 61_760 * 2
    # tp=4 > 2 kv heads: q,o 2048; k,v replicated 2048; mlp 6144; norms 128 -> 10368/layer
    assert weight_bytes_per_rank(TINY, par(tp=4), BF16) == (2 * 10_368 + 2 * 6_144 + 64) * 2
    # pp=2: the last stage (one layer 36992, head 24576, final norm 64) outweighs the first
    # (one layer and the embedding: 61568)
    assert weight_bytes_per_rank(TINY, par(pp=2), BF16) == (36_992 + 24_576 + 64) * 2


def test_moe_weight_bytes_follow_the_engine_layout():
    expert, router, norms = 3 * 64 * 32, 64 * 4, 128
    attn_tp2, attn_tp1 = 4096 + 2048, 8192 + 4096

    def rank_params(parallel):
        return weight_bytes_per_rank(TINY_MOE, parallel, 1)
    # tp=2, ep=1: all 4 experts split in halves; tp=2, ep=2: 2 whole experts per rank -> same bytes
    layer = attn_tp2 + norms + router + 4 * expert // 2
    assert rank_params(par(tp=2)) == rank_params(par(tp=2, ep=2)) == 2 * layer + 2 * 192 * 64 + 64
    # tp=1, ep=2: attention and the vocab matrices repeat on both ranks, experts split
    layer_ep = attn_tp1 + norms + router + 2 * expert
    assert rank_params(par(ep=2)) == 2 * layer_ep + 2 * 384 * 64 + 64
    # one redundant slot per rank holds one more whole expert per layer
    assert rank_params(par(ep=2, num_redundant_experts=1)) == rank_params(par(ep=2)) + 2 * expert
    # pp=2: the last stage holds one layer, the head and the final norm
    assert rank_params(par(tp=2, ep=2, pp=2)) == layer + 192 * 64 + 64


def test_max_batch_tokens_llama70b_on_8x_h100():
    # per rank, tp=8: layer = q,o 2*8192*8192/8 + k,v 2*8192*128*1 + mlp 3*8192*28672/8 + norms 2*8192
    layer = 16_777_216 + 2_097_152 + 88_080_384 + 16_384
    params = 80 * layer + 2 * 128_256 * 8192 // 8 + 8192  # = 8.82B (70.55B / 8)
    weight_bytes = 2 * params
    assert weight_bytes_per_rank(LLAMA70B, par(tp=8), BF16) == weight_bytes == 17_640_734_720
    free_bytes = 80 * 2**30 * 0.9 - weight_bytes  # 59.67 GB for KV (H100: 80 GiB)
    expected = int(free_bytes // (327_680 // 8))
    assert expected == 1_456_754
    assert max_batch_tokens(LLAMA70B, par(tp=8), get_hardware("h100"), BF16) == expected
    assert max_batch_tokens(LLAMA70B, par(tp=1), get_hardware("h100"), BF16) == 0  # 141 GB > 80 GiB
    # 1_456_754 tokens = 91_047 blocks of 16; a 4096 + 1024 token sequence takes 320 blocks
    assert max_num_seqs_that_fit(expected, 5120) == 91_047 // 320 == 284


def test_collective_formulas():
    # 1 GB over 8 ranks at 100 GB/s, 1 us: 2*7/8 * 10 ms + 14 us
    assert ring_allreduce_time_s(1e9, 8, 100e9, 1e-6) == pytest.approx(0.0175 + 14e-6)
    assert ring_allreduce_time_s(1e9, 1, 100e9, 1e-6) == 0.0
    assert all_to_all_time_s(1e9, 4, 100e9, 1e-6) == pytest.approx(0.75 * 0.01 + 3e-6)
    assert all_gather_time_s(1e9, 4, 100e9, 1e-6) == pytest.approx(0.75 * 0.01 + 3e-6)
    assert p2p_time_s(1e6, 1e9, 5e-6) == pytest.approx(1e-3 + 5e-6)


def test_layout_validation_is_the_engines():
    dep(LLAMA70B, par(tp=8, pp=4))
    dep(MIXTRAL, par(tp=1, ep=8))  # experts over 8 ranks, attention repeated on each
    dep(MIXTRAL, par(tp=2, ep=8))
    cases = [(LLAMA70B, par(tp=3), "does not divide"),
             (LLAMA70B, par(pp=81), "exceeds"),
             (LLAMA70B, par(tp=8, ep=2), "dense"),
             (MIXTRAL, par(tp=1, ep=3), "does not divide the model's 8 experts"),
             (MIXTRAL, par(tp=4, ep=2), "tp=4 must divide ep=2"),
             (dataclasses.replace(TINY, num_heads=12, num_kv_heads=3), par(tp=4), "KV heads")]
    for model, parallel, match in cases:
        with pytest.raises(ConfigError, match=match):
            dep(model, parallel)
    with pytest.raises(ConfigError, match="float8"):
        dep(LLAMA70B, par(tp=8), "a100", dtype="float8")
    with pytest.raises(ConfigError):
        weight_bytes_per_rank(LLAMA70B, par(tp=3), BF16)


def test_decode_bottleneck_switches_from_memory_to_compute():
    llama = dep(LLAMA70B, par(tp=8))
    small = decode_step_time(llama, batch_size=1, context_len=1024)
    large = decode_step_time(llama, batch_size=2048, context_len=1024)
    assert small.bottleneck == "memory" and large.bottleneck == "compute"
    # batch 1 reads 80 layers of linear weights and the LM head shard: 8.688B params per rank
    read_params = 80 * (16_777_216 + 2_097_152 + 88_080_384) + 16_032 * 8192
    kv_bytes = 1024 * 2 * 80 * 1 * 128 * 2
    # the one token's activations, per layer: 12 h through the residual stream, 6 I / tp in the MLP
    activation_bytes = 80 * (12 * 8192 + 6 * 28672 // 8) * 2
    assert small.memory_s == pytest.approx((read_params * 2 + kv_bytes + activation_bytes) / H100_BW)
    assert large.total_s > small.total_s
    assert not small.calibrated and "uncalibrated" in small.summary()
    assert "calibrated" in dataclasses.replace(small, calibrated=True).summary()


def test_step_time_rule_and_batch_forms_agree():
    tiny = dep(TINY, par(tp=2), efficiency=Efficiency(step_overhead_s=1e-3, overlap=1.0))  # the classic roofline
    entries = [(16, 48)] + [(1, 100)] * 3
    summary = BatchSummary(num_prefill_tokens=16, prefill_context_len=48, num_decode_seqs=3, decode_context_len=100)
    a, b = step_time(tiny, entries), step_time(tiny, summary)
    assert a == b
    # read per rank: 2 layers * (attention 6144 + mlp 12288) linear params + LM head 192*64 (the
    # embedding is only looked up), and K/V of 48 + 3*100 context tokens at 2 layers * 1 kv head
    # * 16 * 2 (K, V) * 2 bytes
    weight_read_bytes = (2 * 18_432 + 12_288) * 2
    kv_read_bytes = (48 + 300) * (2 * 2 * 1 * 16 * 2)
    activation_bytes = 19 * 2 * (12 * 64 + 6 * 128 // 2) * 2  # 19 tokens, 2 layers (activation_traffic.py)
    assert a.memory_s == pytest.approx((weight_read_bytes + kv_read_bytes + activation_bytes) / H100_BW)
    # total = max(gemm, weights) + max(attention, kv) + comm + overhead; tiny shapes are memory-bound
    assert a.total_s == pytest.approx(a.memory_s + a.comm_s + a.overhead_s)
    # 2 all-reduces of 19 x 64 bf16 per layer, one for the embedding; the 4 rows of logits gathered
    allreduce = ring_allreduce_time_s(19 * 64 * 2, 2, *NVLINK)
    assert a.comm_s == pytest.approx(5 * allreduce + all_gather_time_s(4 * 384 * 2, 2, *NVLINK))


def test_activation_traffic_does_not_shrink_with_tp_and_follows_the_routed_rows():
    """Per layer and token 12 h through the residual stream on every rank of a tp group (each holds
    the whole hidden state), 6 I / tp in a dense MLP; a MoE layer adds 6 I_e / tp_e + 4 h per
    routed row on the busiest expert rank."""
    batch = BatchSummary(num_decode_seqs=8, decode_context_len=100)
    for tp in (1, 2):
        work = step_work(dep(TINY, par(tp=tp)), batch)
        assert work.activation_traffic_bytes == 8 * 2 * (12 * 64 + 6 * 128 / tp) * BF16
    rows = busiest_rank_rows(TINY_MOE, 2, 8)  # 8 tokens x top-2 over 2 expert ranks: 8 on average
    assert 8 < rows <= 16
    work = step_work(dep(TINY_MOE, par(ep=2)), batch)
    assert work.activation_traffic_bytes == pytest.approx(2 * (8 * 12 * 64 + rows * (6 * 32 + 4 * 64)) * BF16)


def test_pipeline_step_is_sum_of_stages_plus_slowest_per_extra_micro_batch():
    # TINY, pp=2, decode 4 seqs at context 100 -> 2 micro-batches of 2 seqs (200 context tokens)
    t = decode_step_time(dep(TINY, par(pp=2)), batch_size=4, context_len=100)
    layer_params = 12_288 + 24_576  # attention + MLP, unsharded
    kv_bytes = 200 * (2 * 1 * 2 * 16 * 2)
    activation_bytes = 2 * (12 * 64 + 6 * 128) * 2  # 2 tokens through a layer
    stage0 = (layer_params * 2 + kv_bytes + activation_bytes) / H100_BW + p2p_time_s(2 * 64 * 2, *NVLINK)  # [2, 64]
    stage1 = ((layer_params + 384 * 64) * 2 + kv_bytes + activation_bytes) / H100_BW  # holds the head
    assert t.total_s == pytest.approx(stage0 + stage1 + max(stage0, stage1) + 2e-3)
    one_micro = decode_step_time(dep(TINY, par(pp=2, num_micro_batches=1)), batch_size=4, context_len=100)
    assert one_micro.total_s < t.total_s  # memory-bound: splitting re-reads the weights


def test_prefill_is_compute_bound_and_pipeline_adds_p2p():
    one = prefill_time(dep(LLAMA70B, par(tp=8)), prompt_len=4096)
    assert one.bottleneck in ("compute", "network") and one.gemm_s > one.memory_s
    # 2 FLOPs * 80 layers * 855.6M layer params * 4096 tokens / 8 ranks at 0.6 * 989.4 TFLOP/s,
    # plus the LM head for the one sampled row (the embedding is a lookup, not a GEMM)
    layer_params = 8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672
    expected_flops = 2 * 80 * layer_params * 4096 / 8 + 2 * 8192 * 128_256 / 8
    assert one.gemm_s == pytest.approx(expected_flops / H100_PEAK)
    staged = prefill_time(dep(LLAMA70B, par(tp=8, pp=2)), prompt_len=4096)
    # same collectives, plus one p2p of 4096 x 8192 bf16 from rank 7 to rank 8: another node, the NIC
    assert staged.comm_s == pytest.approx(one.comm_s + p2p_time_s(4096 * 8192 * 2, 0.7 * 50e9, 5e-6))
    assert staged.gemm_s == pytest.approx(one.gemm_s)


def test_collectives_move_bf16_activations_under_fp8_weights():
    """fp8 halves the weight bytes, not the activations every engine reduces in bfloat16."""
    bf16 = decode_step_time(dep(LLAMA70B, par(tp=8)), batch_size=32, context_len=1024)
    fp8 = decode_step_time(Deployment(LLAMA70B, par(tp=8), get_hardware("h100"), "float8"), batch_size=32,
                           context_len=1024)
    assert fp8.comm_s == pytest.approx(bf16.comm_s)
    assert fp8.memory_s < bf16.memory_s


def test_expert_parallel_compute_and_all_to_all_by_hand():
    # TINY_MOE, tp=1, ep=2, decode 4 seqs: each rank routes 2 tokens; 4*2/2 = 4 expert rows per
    # rank on average, and the busiest of the 2 ranks gets 4 + z_2 sigma: a token's rows to one
    # rank are hypergeometric (2 of 4 experts drawn, 2 of them the rank's), variance
    # 2 * 1/2 * 1/2 * (4-2)/(4-1) = 1/3, over 4 tokens sigma = sqrt(4/3); z_2 (Blom) = Phi^-1(1.625/2.25)
    rows = 4 + NormalDist().inv_cdf(1.625 / 2.25) * math.sqrt(4 / 3)
    assert rows == pytest.approx(4.6806, abs=1e-4)
    t = decode_step_time(dep(TINY_MOE, par(ep=2)), batch_size=4, context_len=10)
    attention_flops = 2 * 4 * (8192 + 4096)  # per layer, unsharded on each rank
    moe_flops = 2 * 2 * 64 * 4 + 2 * rows * 6144  # router on 2 tokens, the busiest rank's rows through whole experts
    head_flops = 2 * 4 * 384 * 64
    assert t.gemm_s == pytest.approx((2 * (attention_flops + moe_flops) + head_flops) / H100_PEAK)
    # per layer: dispatch + combine of the busiest rank's rows * 64 * 2 bytes, all-gather of [4, 64]
    a2a = all_to_all_time_s(rows * 64 * 2, 2, *NVLINK)
    assert t.comm_s == pytest.approx(2 * (2 * a2a + all_gather_time_s(4 * 64 * 2, 2, *NVLINK)))
    # ep=1, tp=2 instead: one all-reduce after attention and one after the experts, per layer
    tp = decode_step_time(dep(TINY_MOE, par(tp=2)), batch_size=4, context_len=10)
    allreduce = ring_allreduce_time_s(4 * 64 * 2, 2, *NVLINK)
    assert tp.comm_s == pytest.approx(5 * allreduce + all_gather_time_s(4 * 384 * 2, 2, *NVLINK))


def test_moe_decode_reads_only_hit_experts():
    assert fraction_of_experts_hit(MIXTRAL, 1) == pytest.approx(0.25)
    assert fraction_of_experts_hit(MIXTRAL, 256) == pytest.approx(1.0)
    mixtral = dep(MIXTRAL, par(tp=8, ep=8))
    one, many = decode_step_time(mixtral, 1, 16), decode_step_time(mixtral, 256, 16)
    assert many.memory_s > 2.5 * one.memory_s  # 8 experts read instead of ~2
    assert one.comm_s != decode_step_time(dep(MIXTRAL, par(tp=8)), 1, 16).comm_s


def test_efficiency_validation():
    with pytest.raises(ConfigError, match="gemm"):
        Efficiency(gemm=0)
    with pytest.raises(ConfigError, match="step_overhead_s"):
        Efficiency(step_overhead_s=-1)


# Latent attention (MLA): 4 heads, q through a 24-wide bottleneck, kv latent 32 + a shared rotary
# key of 8; per head 16 no-rope + 8 rope dims of query/key and 16 of value (head_dim 24).
TINY_MLA = dataclasses.replace(TINY, architecture="deepseek_v3", head_dim=24, num_kv_heads=4,
                               mla=MlaShape(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            q_lora_rank=24))


def test_latent_attention_params_cache_and_flops_by_hand():
    # q: 64x24 down (replicated) + 24 x 4 heads x 24 up; kv: 64 x (32 + 8) down (replicated) + 32 x 4 x (16 + 16)
    assert qkv_params(TINY_MLA) == 64 * 24 + 24 * 4 * 24 + 64 * 40 + 32 * 4 * 32
    assert qkv_params(TINY_MLA, 2) == 64 * 24 + 24 * 4 * 24 // 2 + 64 * 40 + 32 * 4 * 32 // 2
    assert o_params(TINY_MLA) == 4 * 16 * 64
    # the cache is the latent, whole on every tp rank (GQA would split 2 x 4 heads x 24 over tp)
    assert kv_values_per_token(TINY_MLA, 1) == kv_values_per_token(TINY_MLA, 2) == 40
    # a prefill pair up-projects to per-head keys and values (24 + 16 per head, x2 FLOPs, QK and PV);
    # a decode pair attends over the latent itself (40 for QK, 32 for PV)
    assert attention_flops_per_pair(TINY_MLA) == 2 * 4 * (24 + 16)
    assert attention_flops_per_pair(TINY_MLA, decode=True) == 2 * 4 * (40 + 32)
    work = step_work(dep(TINY_MLA, par()), BatchSummary(num_decode_seqs=3, decode_context_len=10))
    assert work.attention_flops == 2 * 576 * 30
    assert work.kv_bytes == 3 * 10 * 2 * 40 * BF16


def test_data_parallel_attention_splits_the_sequences_and_drops_the_all_gather():
    repeated, split = dep(TINY_MOE, par(ep=4)), dep(TINY_MOE, par(ep=4, dp_attention=True))
    batch = BatchSummary(num_decode_seqs=8, decode_context_len=100)
    # each of the 4 attention groups reads a quarter of the KV and attends for a quarter of the pairs
    assert step_work(split, batch).kv_bytes == pytest.approx(step_work(repeated, batch).kv_bytes / 4)
    assert step_work(split, batch).attention_flops == pytest.approx(step_work(repeated, batch).attention_flops / 4)
    # per layer, the repeated attention needs every token back on every rank ([8, 64] gathered); the
    # groups keep their own: the dispatch and combine all-to-alls are the same
    gap = decode_step_time(repeated, 8, 100).comm_s - decode_step_time(split, 8, 100).comm_s
    assert gap == pytest.approx(2 * all_gather_time_s(8 * 64 * BF16, 4, *NVLINK))
    # and the replica holds 4 times the KV of one rank
    one_rank = max_batch_tokens(TINY_MOE, par(ep=4), get_hardware("h100"), BF16)
    assert max_batch_tokens(TINY_MOE, par(ep=4, dp_attention=True), get_hardware("h100"), BF16) == 4 * one_rank


def test_data_parallel_attention_is_a_planner_layout_only():
    with pytest.raises(ConfigError, match="dp_attention needs ep > tp"):
        par(tp=2, ep=2, dp_attention=True).validate(TINY_MOE)
    with pytest.raises(ConfigError, match="the engine does not run it"):
        EngineConfig(parallel=par(ep=2, dp_attention=True))


def test_data_parallel_attention_charges_the_busiest_group():
    # a sequence lives on one attention group: a lone prompt is attended whole by its group while
    # the others wait at the MoE layers, so dp_attention does not cut its attention time
    repeated, split = dep(TINY_MOE, par(ep=4)), dep(TINY_MOE, par(ep=4, dp_attention=True))
    prompt = [(64, 64)]
    assert step_work(split, prompt).attention_flops == pytest.approx(step_work(repeated, prompt).attention_flops)
    # three prompts over 2 groups, largest first onto the lightest: 40 | 30 + 20, the second busiest
    two = dep(TINY_MOE, par(ep=2, dp_attention=True))
    pairs = 30 * 31 // 2 + 20 * 21 // 2
    assert step_work(two, [(40, 40), (30, 30), (20, 20)]).attention_flops == pytest.approx(
        2 * attention_flops_per_pair(TINY_MOE) * pairs)
    # a summary's prompt chunk sits on one group with that group's quarter of the decodes
    mixed = BatchSummary(num_prefill_tokens=16, prefill_context_len=16, num_decode_seqs=8, decode_context_len=100)
    assert step_work(split, mixed).kv_bytes == pytest.approx(
        step_work(repeated, BatchSummary(num_prefill_tokens=16, prefill_context_len=16, num_decode_seqs=2,
                                         decode_context_len=100)).kv_bytes)


def test_host_overhead_is_per_attention_group():
    # dp_attention: each of the ep / tp = 4 attention groups is its own engine process, whose host
    # prepares and samples only its quarter of the step's sequences and tokens
    eff = Efficiency(step_overhead_s=1e-3, seq_overhead_s=10e-6, token_overhead_s=1e-6)
    shared = dep(QWEN3_MOE, par(tp=1, ep=4), efficiency=eff)
    grouped = dep(QWEN3_MOE, par(tp=1, ep=4, dp_attention=True), efficiency=eff)
    assert decode_step_time(shared, 400, 1000).overhead_s == pytest.approx(1e-3 + 400 * 10e-6 + 400 * 1e-6)
    assert decode_step_time(grouped, 400, 1000).overhead_s == pytest.approx(1e-3 + 100 * 10e-6 + 100 * 1e-6)


def test_kv_dtype_overrides_the_cache_the_weights_keep():
    # fp4 weights keep an fp8 cache (1 byte) unless the engine is told to keep fp16 (2 bytes)
    fp4 = dep(LLAMA70B, par(), hw="b200", dtype="float4")
    fp16_cache = dep(LLAMA70B, par(), hw="b200", dtype="float4", kv_dtype="float16")
    assert (fp4.kv_bytes, fp16_cache.kv_bytes) == (1, 2)
    assert (fp4.attention_dtype, fp16_cache.attention_dtype) == ("float8", "float16")
    # a decode of 64 sequences at 1000 tokens reads 80 layers * 8 kv heads * 128 * 2 (K, V) bytes a token
    kv_read_bytes = 64 * 1000 * 80 * 8 * 128 * 2
    assert step_work(fp16_cache, BatchSummary(num_decode_seqs=64, decode_context_len=1000)).kv_bytes == kv_read_bytes * 2
    assert step_work(fp4, BatchSummary(num_decode_seqs=64, decode_context_len=1000)).kv_bytes == kv_read_bytes
    with pytest.raises(ConfigError):
        dep(LLAMA70B, par(), hw="b200", dtype="float4", kv_dtype="float5")


def test_weights_kept_in_blocks_are_read_at_their_own_bytes():
    # an engine serving GGUF Q4_1 blocks (0.625 bytes a weight) under bfloat16 activations: a step
    # reads its weights at those bytes, its KV and FLOPs as bfloat16's
    bf16 = dep(TINY, par(), hw="h100")
    blocks = dep(TINY, par(), hw="h100", weight_bytes_per_param=0.625)
    batch = BatchSummary(num_decode_seqs=4, decode_context_len=100)
    assert step_work(blocks, batch).weight_bytes == pytest.approx(step_work(bf16, batch).weight_bytes * 0.625 / 2)
    assert step_work(blocks, batch).kv_bytes == step_work(bf16, batch).kv_bytes
    assert step_work(blocks, batch).flops == step_work(bf16, batch).flops
    with pytest.raises(ConfigError):
        dep(TINY, par(), hw="h100", weight_bytes_per_param=0)
