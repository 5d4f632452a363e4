"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket.

On a GPU a decode step of eager PyTorch and Triton is bound by the host: each layer launches about
ten kernels, and at small batches launching one costs the host more than the GPU spends running
it (Llama-3-8B's shape on an H200 at batch 1: a 20.7 ms eager step, where reading the weights
takes 3.8 ms). A graph replays a whole forward pass with one launch.

A graph reads its inputs from static buffers, which `run` fills before each replay: the token
ids, the positions and the attention metadata (the backend's graph_metadata). A step of n
sequences replays the smallest bucket of at least n; the rows past n are padding, which writes
no KV and whose outputs are dropped. Only decode-only steps of a dense model in one process are
replayed: prefill chunks change shape every step, and the MoE layers read expert counts back to
the host.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Callable

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int) -> list[int]:
    """The batch sizes captured for at most `max_batch` sequences a step: the buckets below it and
    max_batch itself."""
    return sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})


class DecodeGraphs:
    """`capture=False` replays by running the model eagerly on the same static buffers: the
    padding and refill rules tested on a CPU (tests/engine/test_cuda_graphs.py)."""

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, kv_layers: list, attention, cache, max_batch: int,
                 max_model_len: int, capture: bool = True):
        device = cache.device
        self.attention = attention
        self.max_batch = max_batch
        self.batches = buckets_up_to(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.meta = attention.graph_metadata(max_batch, -(-max_model_len // cache.block_size), cache)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        pool = None
        for batch in reversed(self.batches):  # the largest first: the rest reuse its memory
            ids, positions = self.input_ids[:batch], self.positions[:batch]
            meta = attention.graph_batch(self.meta, batch)

            def forward(ids=ids, positions=positions, meta=meta) -> torch.Tensor:
                return model(ids, positions, kv_layers, meta)
            if not capture:
                self.replays[batch] = forward
                continue
            side = torch.cuda.Stream()  # warm up (Triton compiles) off the capturing stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward()
            pool = graph.pool()
            self.replays[batch] = lambda graph=graph, out=out: (graph.replay(), out)[1]

    def covers(self, meta, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows with this metadata can be replayed: decodes only."""
        return getattr(meta, "num_decodes", -1) == num_tokens <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's output rows of a decode-only step ([n, hidden], a view of the graph's
        output: read before the next replay)."""
        n = input_ids.shape[0]
        batch = self.batches[bisect_left(self.batches, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.attention.fill_graph_metadata(self.meta, meta, batch)
        return self.replays[batch]()[:n]


def decode_graphs(loaded, max_num_seqs: int, enforce_eager: bool) -> DecodeGraphs | None:
    """The graphs of a single-process engine on a GPU, or None where steps run eagerly."""
    if (enforce_eager or loaded.device.type != "cuda" or loaded.model_config.is_moe
            or loaded.groups.config.world_size != 1 or not hasattr(loaded.attention, "graph_metadata")):
        return None
    return DecodeGraphs(loaded.model, loaded.kv_cache.layers, loaded.attention, loaded.kv_cache,
                        min(max_num_seqs, BATCH_BUCKETS[-1]), loaded.max_model_len)
