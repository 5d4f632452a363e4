"""Parallel layouts: validation (one clear sentence, before any rank starts), how layers split
into pipeline stages, how a step splits into micro-batches."""
from __future__ import annotations

import subprocess
import sys

import pytest

from shardserve.config import ConfigError, ModelConfig, ParallelConfig
from shardserve.engine.interface import ScheduledSeq
from shardserve.engine.worker import split_micro_batches

DENSE = ModelConfig("llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=64)
MOE = ModelConfig("mixtral", vocab_size=100, hidden_size=64, intermediate_size=32, num_layers=4, num_heads=8,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64, num_experts=8, num_experts_per_token=2,
                  moe_intermediate_size=32)


@pytest.mark.parametrize("layout,model,message", [
    (dict(tp_size=3), DENSE, "tp=3 does not divide the model's 8 attention heads"),
    (dict(tp_size=8), DENSE, None),  # 2 KV heads, each replicated on 4 ranks
    (dict(pp_size=5), DENSE, "pp=5 exceeds the model's 4 layers"),
    (dict(ep_size=2), DENSE, "ep=2 needs a mixture-of-experts model; this one is dense"),
    (dict(ep_size=3), MOE, "ep=3 does not divide the model's 8 experts"),
    (dict(tp_size=4, ep_size=2), MOE, "tp=4 must divide ep=2"),
    (dict(tp_size=2, ep_size=4), MOE, None),
    (dict(pp_size=2, pp_layer_partition=(3, 2)), DENSE, "must give each of the 2 stages at least one layer and sum to 4"),
    (dict(tp_size=0), DENSE, "tp=0 must be at least 1"),
])
def test_validate_layout(layout, model, message):
    config = ParallelConfig(**layout)
    if message is None:
        config.validate(model)
    else:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config.validate(model)


def test_world_size_is_pp_times_the_larger_of_tp_and_ep():
    assert ParallelConfig(tp_size=2, pp_size=3).world_size == 6
    assert ParallelConfig(tp_size=2, ep_size=4, pp_size=2).world_size == 8


def test_stages_balance_layer_cost_with_the_head_on_the_last_stage():
    config = ParallelConfig(pp_size=2)
    assert config.stage_layers([1.0] * 30) == [range(0, 15), range(15, 30)]
    # a head as costly as 8 layers: 19 vs 11 + 8 is the best split of 38
    assert config.stage_layers([1.0] * 30, last_stage_cost=8.0) == [range(0, 19), range(19, 30)]
    assert config.stage_layers([5.0, 1, 1, 1, 1, 1]) == [range(0, 1), range(1, 6)]
    explicit = ParallelConfig(pp_size=2, pp_layer_partition=(1, 3))
    assert explicit.stage_layers([1.0] * 4) == [range(0, 1), range(1, 4)]


def test_micro_batches_split_tokens_evenly_in_order():
    seqs = [ScheduledSeq(str(i), 0, n, [], True) for i, n in enumerate([1, 1, 1, 1, 8, 4])]
    parts = split_micro_batches(seqs, 2)
    assert [[s.req_id for s in part] for part in parts] == [["0", "1", "2", "3", "4"], ["5"]]
    assert split_micro_batches(seqs[:1], 3) == [seqs[:1]]  # never an empty micro-batch
    assert sum(len(p) for p in split_micro_batches(seqs, 4)) == len(seqs)


def test_cli_rejects_an_impossible_layout_in_one_line(tiny_checkpoints):
    proc = subprocess.run([sys.executable, "-m", "shardserve.cli", "generate", "--model", str(tiny_checkpoints["llama"]),
                           "--prompt", "hi", "--tp", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shardserve: error: tp=3 does not divide the model's 4 attention heads"
