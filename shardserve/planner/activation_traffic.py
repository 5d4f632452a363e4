"""Activation traffic of one engine step: what the kernels between the GEMMs move through memory.

The kernels between the GEMMs (residual adds, norms, rotary, SiLU * mul, the experts' permutes)
and the GEMMs' own activation reads and writes stream each token's activations through memory, a
cost of its own that grows with the batch and, under tp, does not shrink with it (every rank of a
group holds the whole hidden state). Per layer and token, counted for an engine that fuses the
residual add into the norm:

    12 h            the two add + RMSNorm, each reading x and the residual and writing both (8 h);
                    the h-wide inputs of the QKV and gate/up GEMMs, outputs of o and down (4 h)
    6 I / tp        a dense MLP: gate/up written, read by SiLU * mul, which writes I, read by down
    6 I_e / tp_e + 4 h    per routed row of a MoE layer: the expert MLP, the row's permute in and out
    6 I_s / tp      a shared expert, per token

The cost model (cost_model.py) charges it at the activation dtype and the weights' memory rate,
not overlapped with the GEMMs (separate kernels), times Efficiency.activation_traffic: 1 for a
GPU, whose batches' activations outgrow its cache; 0 in a CPU calibration, whose fitted per-token
host term carries this work.
"""
from __future__ import annotations

from shardserve.config import ModelConfig, ParallelConfig
from shardserve.planner.rank_shards import StagePlan

RESIDUAL_PASSES = 12  # x h, per token
MLP_PASSES = 6  # x the MLP's intermediate size on this rank, per token (dense) or routed row
PERMUTE_PASSES = 4  # x h, per routed row


def activation_elements(model: ModelConfig, par: ParallelConfig, stage: StagePlan, local_tokens: float,
                        routed_rows: float) -> float:
    """Activation elements the stage's kernels stream through memory on one rank: `local_tokens`
    (the busiest attention group's) through the residual stream, dense MLPs and shared experts,
    `routed_rows` (the busiest expert rank's) through the routed experts."""
    tp, ep, h = par.tp_size, par.ep_size, model.hidden_size
    elements = RESIDUAL_PASSES * h * local_tokens * stage.num_layers
    elements += MLP_PASSES * model.intermediate_size / tp * local_tokens * stage.num_dense_layers
    if stage.num_moe_layers:
        per_row = MLP_PASSES * model.moe_intermediate_size / (tp if ep == 1 else 1) + PERMUTE_PASSES * h
        shared = MLP_PASSES * model.shared_expert_intermediate_size / tp * local_tokens
        elements += stage.num_moe_layers * (routed_rows * per_row + shared)
    return elements
