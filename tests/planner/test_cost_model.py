"""Cost model: hand-computed FLOPs, bytes, collectives, memory fit and roofline behaviour."""
from __future__ import annotations

import dataclasses

import pytest

from shardserve.config import ConfigError, ModelConfig
from shardserve.planner.collectives import all_to_all_time_s, p2p_time_s, ring_allreduce_time_s
from shardserve.planner.cost_model import (
    BatchSummary, Efficiency, decode_step_time, fraction_of_experts_hit, kv_bytes_per_token,
    kv_bytes_per_token_per_rank, layer_flops, max_batch_tokens, num_attended_pairs, prefill_time, step_time,
    weight_bytes_per_rank,
)
from shardserve.planner.model_shape import ModelShape, Parallelism, validate_layout
from shardserve.planner.hardware import get_hardware

# h=64, I=128, 4 heads of 16, 2 kv heads, 2 layers, vocab 384.
TINY = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, vocab_size=384)
# Same attention; MLP = 4 experts of width 32, top-2.
TINY_MOE = dataclasses.replace(TINY, intermediate_size=0, num_experts=4, num_experts_per_token=2,
                               expert_intermediate_size=32)
LLAMA70B = ModelShape.llama31_70b()
MIXTRAL = ModelShape.mixtral_8x7b()
BF16 = 2


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
    shared = layer_flops(dataclasses.replace(TINY_MOE, num_shared_experts=1), 8, 8)
    assert shared.mlp_flops == 2 * 8 * 3 * 3 * 64 * 32


def test_mixtral_active_params():
    # per layer: attention 4096*128*(2*32 + 2*8) + 8 experts * 3*4096*14336 + router 4096*8 + norms 2*4096
    per_layer = 41_943_040 + 1_409_286_144 + 32_768 + 8_192
    assert MIXTRAL.num_params == 32 * per_layer + 2 * 32_000 * 4096 + 4096 == 46_702_792_704
    idle_experts = 32 * 6 * 3 * 4096 * 14336
    assert MIXTRAL.num_active_params == 46_702_792_704 - idle_experts  # ~12.9B, as published
    f = layer_flops(MIXTRAL, 1, 1)
    assert f.mlp_flops == 2 * 2 * 3 * 4096 * 14336  # 2 of 8 experts


def test_shape_from_config_matches_model_config():
    cfg = ModelConfig(architecture="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    shape = ModelShape.from_config(cfg)
    assert shape.num_params == cfg.num_params
    assert kv_bytes_per_token(shape, BF16) == cfg.kv_bytes_per_token(BF16)
    assert weight_bytes_per_rank(shape, Parallelism(), 4) == 4 * cfg.num_params


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(LLAMA70B, BF16) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token(MIXTRAL, BF16) == 2 * 32 * 8 * 128 * 2 == 131_072  # experts don't add KV
    assert kv_bytes_per_token_per_rank(LLAMA70B, Parallelism(tp=8), BF16) == 327_680 // 8
    # tp=16 > 8 kv heads: each rank keeps one replicated head, so no further saving
    assert kv_bytes_per_token_per_rank(LLAMA70B, Parallelism(tp=16), BF16) == 327_680 // 8
    assert kv_bytes_per_token_per_rank(LLAMA70B, Parallelism(tp=8, pp=3), BF16) == 2 * 27 * 1 * 128 * 2


def test_weight_bytes_per_rank_by_hand():
    # tp=2: q,o 2*64*64/2 = 4096; k,v 2*64*16*1 = 2048; mlp 3*64*128/2 = 12288; norms 128 -> 18560/layer
    # 2 layers = 37120; embedding + head 2 * 384*64/2 = 24576; final norm 64 -> 61760 params
    assert weight_bytes_per_rank(TINY, Parallelism(tp=2), BF16) == 61_760 * 2
    # tp=4 > 2 kv heads: q,o 2048; k,v replicated 2048; mlp 6144; norms 128 -> 10368/layer
    assert weight_bytes_per_rank(TINY, Parallelism(tp=4), BF16) == (2 * 10_368 + 2 * 6_144 + 64) * 2
    # pp=2: one layer (8192 + 4096 + 24576 + 128) and one vocab matrix 24576 on the busiest stage
    assert weight_bytes_per_rank(TINY, Parallelism(pp=2), BF16) == (36_992 + 24_576 + 64) * 2


def test_moe_weight_bytes_split_by_tp_and_ep():
    expert = 3 * 64 * 32

    def rank_params(par):
        return weight_bytes_per_rank(TINY_MOE, par, 1)
    # ep=2 over tp=2: 2 whole experts per rank; ep=1: 4 experts halved -> same bytes, different layout
    assert rank_params(Parallelism(tp=2, ep=2)) == rank_params(Parallelism(tp=2, ep=1))
    attn, router, norms, vocab = 2 * 64 * 64 // 2 + 2 * 64 * 16, 64 * 4, 128, 2 * 384 * 64 // 2
    assert rank_params(Parallelism(tp=2, ep=2)) == 2 * (attn + router + 2 * expert + norms) + vocab + 64
    # pp halves the layers and keeps one vocab matrix per stage
    assert rank_params(Parallelism(tp=2, ep=2, pp=2)) == (attn + router + 2 * expert + norms) + vocab // 2 + 64
    # tp=4, ep=2: 2 experts per rank split 2 ways == ep=4: 1 whole expert per rank
    assert rank_params(Parallelism(tp=4, ep=2)) == rank_params(Parallelism(tp=4, ep=4))


def test_max_batch_tokens_llama70b_on_8x_h100():
    # per rank, tp=8: layer = q,o 2*8192*8192/8 + k,v 2*8192*128*1 + mlp 3*8192*28672/8 + norms 2*8192
    layer = 16_777_216 + 2_097_152 + 88_080_384 + 16_384
    params = 80 * layer + 2 * 128_256 * 8192 // 8 + 8192  # = 8.82B (70.55B / 8)
    weight_bytes = 2 * params
    assert weight_bytes_per_rank(LLAMA70B, Parallelism(tp=8), BF16) == weight_bytes == 17_640_734_720
    free_bytes = 80e9 * 0.9 - weight_bytes  # 54.36 GB for KV
    expected = int(free_bytes // (327_680 // 8))
    assert expected == 1_327_130
    assert max_batch_tokens(LLAMA70B, Parallelism(tp=8), get_hardware("h100"), BF16) == expected
    assert max_batch_tokens(LLAMA70B, Parallelism(tp=1), get_hardware("h100"), BF16) == 0  # 141 GB > 80 GB


def test_collective_formulas():
    # 1 GB over 8 ranks at 100 GB/s, 1 us: 2*7/8 * 10 ms + 14 us
    assert ring_allreduce_time_s(1e9, 8, 100e9, 1e-6) == pytest.approx(0.0175 + 14e-6)
    assert ring_allreduce_time_s(1e9, 1, 100e9, 1e-6) == 0.0
    assert all_to_all_time_s(1e9, 4, 100e9, 1e-6) == pytest.approx(0.75 * 0.01 + 3e-6)
    assert p2p_time_s(1e6, 1e9, 5e-6) == pytest.approx(1e-3 + 5e-6)


def test_layout_validation():
    validate_layout(LLAMA70B, Parallelism(tp=8, pp=4))
    validate_layout(MIXTRAL, Parallelism(tp=8, ep=8))
    cases = [(LLAMA70B, Parallelism(tp=3), "does not divide num_heads"),
             (LLAMA70B, Parallelism(pp=81), "exceeds num_layers"),
             (LLAMA70B, Parallelism(tp=8, ep=2), "needs an MoE model"),
             (MIXTRAL, Parallelism(tp=4, ep=3), "does not divide num_experts"),
             (MIXTRAL, Parallelism(tp=2, ep=4), "must divide tp"),
             (dataclasses.replace(TINY, num_heads=12, num_kv_heads=3), Parallelism(tp=4), "num_kv_heads")]
    for shape, par, match in cases:
        with pytest.raises(ConfigError, match=match):
            validate_layout(shape, par)
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        Parallelism(tp=0)
    with pytest.raises(ConfigError):
        weight_bytes_per_rank(LLAMA70B, Parallelism(tp=3), BF16)


def test_decode_bottleneck_switches_from_memory_to_compute():
    h100, par = get_hardware("h100"), Parallelism(tp=8)
    small = decode_step_time(LLAMA70B, par, h100, "bfloat16", batch_size=1, context_len=1024)
    large = decode_step_time(LLAMA70B, par, h100, "bfloat16", batch_size=2048, context_len=1024)
    assert small.bottleneck == "memory" and large.bottleneck == "compute"
    # batch 1 reads ~17.6 GB of weights per rank at 0.8 * 3.35 TB/s: ~6.5 ms
    assert small.memory_s == pytest.approx(17.4e9 / (0.8 * 3.35e12), rel=0.05)
    assert large.total_s > small.total_s
    assert not small.calibrated and "uncalibrated" in small.summary()
    assert "calibrated" in dataclasses.replace(small, calibrated=True).summary()


def test_step_time_rule_and_batch_forms_agree():
    h100, par, eff = get_hardware("h100"), Parallelism(tp=2), Efficiency(step_overhead_s=1e-3)
    entries = [(16, 48)] + [(1, 100)] * 3
    summary = BatchSummary(num_prefill_tokens=16, prefill_context_len=48, num_decode_seqs=3, decode_context_len=100)
    a = step_time(TINY, par, h100, "bfloat16", entries, eff)
    b = step_time(TINY, par, h100, "bfloat16", summary, eff)
    assert a == b
    # read per rank: 2 layers * 18560 params + LM head 384*64/2 (the embedding is only looked up),
    # and K/V of 48 + 3*100 context tokens at 2 layers * 1 kv head * 16 * 2 (K, V) * 2 bytes
    weight_read_bytes = (2 * 18_560 + 12_288) * 2
    kv_read_bytes = (48 + 300) * (2 * 2 * 1 * 16 * 2)
    assert a.memory_s == pytest.approx((weight_read_bytes + kv_read_bytes) / (0.8 * 3.35e12))
    # total = max(gemm, weights) + max(attention, kv) + comm + overhead; tiny shapes are memory-bound
    assert a.total_s == pytest.approx(a.memory_s + a.comm_s + a.overhead_s)
    assert a.comm_s == pytest.approx(2 * 2 * ring_allreduce_time_s(19 * 64 * 2, 2, 450e9 * 0.7, 1e-6))


def test_prefill_is_compute_bound_and_pipeline_adds_p2p():
    h100 = get_hardware("h100")
    one = prefill_time(LLAMA70B, Parallelism(tp=8), h100, "bfloat16", prompt_len=4096)
    assert one.bottleneck in ("compute", "network") and one.gemm_s > one.memory_s
    # 2 FLOPs * 80 layers * 855.8M layer params * 4096 tokens / 8 ranks at 0.7 * 989.4 TFLOP/s,
    # plus the LM head for the one sampled row (the embedding is a lookup, not a GEMM)
    layer_params = 8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672
    expected_flops = 2 * 80 * layer_params * 4096 / 8 + 2 * 8192 * 128_256 / 8
    assert one.gemm_s == pytest.approx(expected_flops / (0.7 * 989.4e12))
    staged = prefill_time(LLAMA70B, Parallelism(tp=8, pp=2), get_hardware("h100"), "bfloat16", prompt_len=4096)
    # same all-reduces per layer, plus one p2p of 4096 x 8192 bf16 over the NIC (16 GPUs > 8 per node)
    assert staged.comm_s == pytest.approx(one.comm_s + p2p_time_s(4096 * 8192 * 2, 0.7 * 50e9, 5e-6))
    assert staged.gemm_s == pytest.approx(one.gemm_s)


def test_moe_decode_reads_only_hit_experts():
    assert fraction_of_experts_hit(MIXTRAL, 1) == pytest.approx(0.25)
    assert fraction_of_experts_hit(MIXTRAL, 256) == pytest.approx(1.0)
    h100, par = get_hardware("h100"), Parallelism(tp=8, ep=8)
    one = decode_step_time(MIXTRAL, par, h100, "bfloat16", 1, 16)
    many = decode_step_time(MIXTRAL, par, h100, "bfloat16", 256, 16)
    assert many.memory_s > 2.5 * one.memory_s  # 8 experts read instead of ~2
    assert one.comm_s != decode_step_time(MIXTRAL, Parallelism(tp=8), h100, "bfloat16", 1, 16).comm_s


def test_efficiency_validation_and_missing_dtype():
    with pytest.raises(ConfigError, match="gemm"):
        Efficiency(gemm=0)
    with pytest.raises(ConfigError, match="float8"):
        decode_step_time(LLAMA70B, Parallelism(tp=8), get_hardware("a100"), "float8", 1, 10)
