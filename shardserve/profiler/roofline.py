"""FLOPs and bytes per op class of a step, MFU / MBU, and what bounds a step.

GEMM and attention work come from the planner's cost model (`cost_model.step_work`: the same
counts its step times divide by the peaks), so the profiler and the planner agree on what a step
asks for. The elementwise and sampling figures are estimates, used only to place those classes
on the roofline:

    elementwise, per token and layer: ~(8 h + 3 I/tp + 5 (H + KV) d / tp) elements read or
        written (two fused add+RMSNorms, SwiGLU's gate/up/out, rotary on q and k, the KV write),
        ~(8 h + 4 I/tp + 3 (H + KV) d / tp) FLOPs
    sampling, per sequence: the float32 logits row read once, ~1 FLOP per logit (greedy argmax)

MFU = (GEMM + attention FLOPs) / (step time * peak FLOP/s); MBU = (weight + KV bytes) / (step
time * memory bandwidth), per device (a pipeline stage's share of the step's work).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.cost_model import Deployment, step_work

# Classes that do arithmetic on the roofline; the other two are not FLOP-bound or byte-bound work.
ROOFLINE_CLASSES = ("gemm", "attention", "elementwise", "sampling")
BOTTLENECKS = ("compute", "memory", "network", "host")


@dataclass(frozen=True)
class OpWork:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else float("inf")


def op_class_work(dep: Deployment, batch) -> dict[str, OpWork]:
    """Work per roofline class of one step of `batch` ((new tokens, context) per sequence), per
    device: the sum over a pipeline's stages divided by their number."""
    model, par = dep.model, dep.parallel
    share = 1.0 / par.pp_size
    work = step_work(dep, batch)
    num_tokens, num_seqs = sum(t for t, _ in batch), len(batch)
    h, inter, tp = model.hidden_size, model.intermediate_size, par.tp_size
    heads_dim = (model.num_heads + model.num_kv_heads) * model.head_dim / tp
    per_token_layers = num_tokens * model.num_layers * share
    return {
        "gemm": OpWork(work.gemm_flops * share, work.weight_bytes * share),
        "attention": OpWork(work.attention_flops * share, work.kv_bytes * share),
        "elementwise": OpWork(per_token_layers * (8 * h + 4 * inter / tp + 3 * heads_dim),
                              per_token_layers * (8 * h + 3 * inter / tp + 5 * heads_dim) * dep.dtype_bytes),
        "sampling": OpWork(num_seqs * model.vocab_size, num_seqs * model.vocab_size * 4),
    }


def peak_rates(dep: Deployment) -> tuple[float, float]:
    """(peak FLOP/s, memory bytes/s) of one device."""
    return dep.hardware.peak_flop_s_for(dep.dtype), dep.hardware.memory_bandwidth_bytes_s


def utilization(dep: Deployment, work: dict[str, OpWork], step_s: float) -> tuple[float, float]:
    """(MFU, MBU) of a step that did `work` in `step_s` seconds."""
    peak_flop_s, bandwidth = peak_rates(dep)
    flops = work["gemm"].flops + work["attention"].flops
    num_bytes = work["gemm"].bytes + work["attention"].bytes
    return flops / (step_s * peak_flop_s), num_bytes / (step_s * bandwidth)


def bottleneck_shares(dep: Deployment, work: dict[str, OpWork], class_s: dict[str, float]) -> dict[str, float]:
    """Seconds of a step by what bounds them: a GEMM or attention class is compute-bound when its
    FLOPs take longer at peak than its bytes at full bandwidth (above the ridge point), else
    memory-bound; elementwise work is memory-bound; communication is network; scheduling, input
    preparation, Python glue and sampling are host overhead."""
    peak_flop_s, bandwidth = peak_rates(dep)
    shares = dict.fromkeys(BOTTLENECKS, 0.0)
    for cls in ("gemm", "attention"):
        bound = "compute" if work[cls].flops / peak_flop_s >= work[cls].bytes / bandwidth else "memory"
        shares[bound] += class_s[cls]
    shares["memory"] += class_s["elementwise"]
    shares["network"] += class_s["comm"]
    shares["host"] += class_s["host"] + class_s["sampling"]
    return shares


def bottleneck_of(shares: dict[str, float]) -> str:
    return max(BOTTLENECKS, key=lambda name: shares[name])
