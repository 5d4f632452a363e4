"""Expert-parallel load: the busiest rank's routed rows under uniform top-k routing, by hand."""
from __future__ import annotations

import dataclasses
import math

import pytest

from shardserve.config import ModelConfig
from shardserve.planner.expert_load import (
    busiest_rank_rows, expected_max_standard_normal, rank_rows_variance_per_token,
)
from shardserve.planner.model_presets import preset

# 4 experts, top-2 (the shape of tests/planner/test_cost_model.py's TINY_MOE)
TINY_MOE = ModelConfig(architecture="mixtral", vocab_size=384, hidden_size=64, intermediate_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, num_experts=4,
                       num_experts_per_token=2, moe_intermediate_size=32)
DEEPSEEK = preset("deepseek-v3")  # 256 experts, top-8


def test_expected_max_of_normals_matches_the_exact_order_statistics():
    # exact E[max] of 2, 4 and 8 standard normals: 1/sqrt(pi) = 0.5642, 1.0294, 1.4236
    assert expected_max_standard_normal(1) == 0.0
    assert expected_max_standard_normal(2) == pytest.approx(0.5642, rel=0.05)
    assert expected_max_standard_normal(4) == pytest.approx(1.0294, rel=0.03)
    assert expected_max_standard_normal(8) == pytest.approx(1.4236, rel=0.01)


def test_a_tokens_rows_to_one_rank_are_hypergeometric():
    # 2 of 4 experts drawn, 2 of the 4 on the rank: var = 2 * 1/2 * 1/2 * 2/3 = 1/3
    assert rank_rows_variance_per_token(TINY_MOE, 2) == pytest.approx(1 / 3)
    # DeepSeek, 8 ranks of 32 experts: 8 * 1/8 * 7/8 * 248/255
    assert rank_rows_variance_per_token(DEEPSEEK, 8) == pytest.approx(8 / 8 * 7 / 8 * 248 / 255)
    assert rank_rows_variance_per_token(DEEPSEEK, 1) == 0.0  # one rank holds every expert


def test_busiest_rank_rows_by_hand():
    # DeepSeek on 8 ranks, 2048 tokens: mean 2048 * 8 / 8 = 2048 rows, sigma = sqrt(2048 * var)
    sigma = math.sqrt(2048 * 8 / 8 * 7 / 8 * 248 / 255)
    expected = 2048 + expected_max_standard_normal(8) * sigma
    assert busiest_rank_rows(DEEPSEEK, 8, 2048) == pytest.approx(expected)
    assert 1.02 < busiest_rank_rows(DEEPSEEK, 8, 2048) / 2048 < 1.04  # ~3% above the mean at this batch
    # one token: at most min(k, experts per rank) = 2 of its 2 rows on one rank of TINY_MOE
    assert busiest_rank_rows(TINY_MOE, 2, 1) <= 2
    # without expert parallelism every row is the rank's; a dense model routes nothing
    assert busiest_rank_rows(DEEPSEEK, 1, 100) == 800
    assert busiest_rank_rows(dataclasses.replace(TINY_MOE, num_experts=0, num_experts_per_token=0), 4, 100) == 0


def test_the_excess_shrinks_like_one_over_root_tokens():
    excess = [busiest_rank_rows(DEEPSEEK, 8, t) / (t * 8 / 8) - 1 for t in (64, 6400)]
    assert excess[0] / excess[1] == pytest.approx(10, rel=1e-6)
