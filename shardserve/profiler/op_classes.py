"""Attributes a torch.profiler trace of one engine step to op classes.

    gemm         inside the linear layers, the LM head and the MoE experts (our panel kernel,
                 oneDNN or cuBLAS matmuls and the Python that calls them)
    attention    inside the attention block, less its q/k/v and output projections: rotary,
                 the KV-cache write and the attention kernel (SDPA, or the native CPU decode
                 kernel, which is not a torch op and shows up as the block's own time)
    elementwise  every other op of the forward pass: norms, activations, residual adds,
                 embedding lookups, MoE routing
    comm         collectives and point-to-point transfers, per collective (by op name)
    sampling     the sampler after the LM head (argmax, random draws, logprobs)
    host         scheduling, input preparation, the model's Python glue between layers,
                 detokenization and outputs

How: during a profiled step, forward hooks open a labelled range around each module of the
first three kinds (`module_scopes`), and the StepProbe labels the step's phases. Every event's
self time (its time less its children's) then goes to a class: a communication op, or an op
inside one, is comm; otherwise the nearest enclosing label decides. The flat layer loop
(models/flat_layers.py) calls the kernels without going through the modules: there a native
kernel op, or an op inside one, takes its class from the kernel's name (`KERNEL_CLASSES`). The
self times of a step's events partition the step, so the classes sum to the profiled step's wall
time.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn
from torch.autograd.profiler import record_function

from shardserve.layers.experts import Experts
from shardserve.layers.linear import Linear
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.models.decoder import Attention
from shardserve.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.profiler.step_probe import PHASE_LABEL, PHASES, STEP_LABEL

OP_CLASSES = ("gemm", "attention", "elementwise", "comm", "sampling", "host")
MODULE_LABEL = "shardserve/op/"

# label -> (class of the ops inside it, class of the label's own time: Python between the ops)
_PHASE_CLASSES = {
    "schedule": ("host", "host"), "prepare": ("host", "host"), "update": ("host", "host"),
    "other": ("host", "host"), "forward": ("elementwise", "host"), "sample": ("sampling", "sampling"),
}
# substrings of communication op names (c10d::allreduce_, gloo:all_reduce, nccl:all_gather, ...)
_COLLECTIVES = (("all_reduce", ("allreduce", "all_reduce")), ("all_gather", ("allgather", "all_gather")),
                ("all_to_all", ("alltoall", "all_to_all")), ("reduce_scatter", ("reduce_scatter",)),
                ("broadcast", ("broadcast",)), ("p2p", ("send", "recv")), ("barrier", ("barrier",)))
_COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
# op name prefix -> class, for kernels called outside any module scope (the flat layer loop)
KERNEL_CLASSES = (("shardserve_panel_linear::", "gemm"), ("mkldnn::_linear_pointwise", "gemm"),
                  ("shardserve_paged_decode_attention::", "attention"),
                  ("shardserve_paged_prefill_attention::", "attention"),
                  ("shardserve_fused_elementwise::rotary_kv", "attention"))


def module_class(module: nn.Module) -> str | None:
    """The op class a module's time belongs to, or None (its ops belong to the enclosing scope)."""
    if isinstance(module, (Linear, ParallelLMHead, Experts)):  # the LM head subclasses the embedding
        return "gemm"
    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, (RMSNorm, VocabParallelEmbedding, RotaryEmbedding)):
        return "elementwise"
    return None


@contextmanager
def module_scopes(model: nn.Module):
    """Label every classified module's forward as a torch.profiler range, for the duration."""
    handles, open_ranges = [], []

    def enter(label):
        def hook(module, args):
            rf = record_function(label)
            rf.__enter__()
            open_ranges.append(rf)
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        cls = module_class(module)
        if cls is not None:
            handles.append(module.register_forward_pre_hook(enter(MODULE_LABEL + cls)))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def collective_of(name: str) -> str | None:
    """The collective a profiler event name stands for, or None when it is no communication op."""
    lowered = name.lower()
    if not lowered.startswith(_COMM_PREFIXES):
        return None
    for collective, needles in _COLLECTIVES:
        if any(n in lowered for n in needles):
            return collective
    return "other"


@dataclass
class ClassSplit:
    """Seconds per (phase, op class) of one profiled step, and communication per collective.
    `seconds[phase][cls]`; every phase of step_probe.PHASES, every class of OP_CLASSES."""

    seconds: dict[str, dict[str, float]] = field(
        default_factory=lambda: {p: dict.fromkeys(OP_CLASSES, 0.0) for p in PHASES})
    comm_by_collective: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def phase_total_s(self, phase: str) -> float:
        return sum(self.seconds[phase].values())

    @property
    def total_s(self) -> float:
        return sum(self.phase_total_s(p) for p in PHASES)


def _scope(label: str) -> tuple[str, str, str] | None:
    """(phase or None, inner class, own class) of a label event name, None for other events."""
    if label.startswith(PHASE_LABEL):
        phase = label[len(PHASE_LABEL):]
        return (phase, *_PHASE_CLASSES[phase])
    if label.startswith(MODULE_LABEL):
        cls = label[len(MODULE_LABEL):]
        return (None, cls, cls)
    return None


def kernel_class(name: str) -> str | None:
    return next((cls for prefix, cls in KERNEL_CLASSES if name.startswith(prefix)), None)


def _classify(event) -> tuple[str, str, str | None]:
    """(phase, class, collective) of one event's self time: walk up to the nearest phase label;
    the first communication op on the way makes it comm, else the first label or named kernel
    decides."""
    phase, cls, collective, node = None, None, None, event
    while node is not None and node.name != STEP_LABEL:
        if cls is None and collective is None:
            collective = collective_of(node.name)
        if cls is None and collective is None:
            cls = kernel_class(node.name)
        scope = _scope(node.name)
        if scope is not None:
            scope_phase, inner_cls, own_cls = scope
            if cls is None and collective is None:
                cls = own_cls if node is event else inner_cls
            if scope_phase is not None:
                phase = scope_phase
                break
        node = node.cpu_parent
    phase = phase or "other"  # directly inside the step: the engine's own bookkeeping
    if collective is not None:
        return phase, "comm", collective
    return phase, cls or "host", None


def split_step(events) -> ClassSplit:
    """Split the profiled events of one StepProbe step (labels on) into phases and op classes.
    Only the thread that ran the step counts (other threads' events overlap it in time)."""
    step = next((e for e in events if e.name == STEP_LABEL), None)
    if step is None:
        raise ValueError(f"no {STEP_LABEL!r} range in the trace: profile a StepProbe step with labels on")
    split = ClassSplit()
    split.seconds["other"]["host"] += step.self_cpu_time_total / 1e6
    start, end = step.time_range.start, step.time_range.end
    for event in events:
        if event is step or event.thread != step.thread:
            continue
        if event.time_range.start < start or event.time_range.end > end:
            continue
        phase, cls, collective = _classify(event)
        seconds = event.self_cpu_time_total / 1e6
        split.seconds[phase][cls] += seconds
        if collective is not None:
            split.comm_by_collective[collective] += seconds
    return split
