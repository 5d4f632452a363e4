"""ModelRunner set-up."""
import torch

from shardserve.engine.model_runner import ModelRunner
from shardserve.layers.attention.backend import attention_backend
from shardserve.layers import cpu_kernels


def test_cpu_runner_builds_the_native_kernels_before_any_request(monkeypatch):
    """Building a CPU runner and its attention backend builds their kernels. The sampler's and the
    MLP's kernels are loaded on first use; on a fresh machine that meant
    compiling them while the first request waited (about 20 s, after /health already said ready)."""
    loaded = []
    load = cpu_kernels._load
    monkeypatch.setattr(cpu_kernels, "_load", lambda name: loaded.append(name) or load(name))
    cpu = torch.device("cpu")
    ModelRunner(torch.nn.Identity(), None, None, (), cpu, attention_backend(cpu))
    assert {"paged_decode_attention", "fused_elementwise", "argmax_rows"} <= set(loaded)
