"""Helpers shared by engine tests: per-token logits through our runner, and transformers refs."""
from __future__ import annotations

import torch

from shardserve.engine.interface import ScheduledSeq
from shardserve.engine.sampler import SamplingState
from shardserve.request import Request, SamplingParams


def engine_logits(engine, token_ids: list[int], chunk_size: int) -> torch.Tensor:
    """Logits [len(token_ids), vocab] computed by our model runner, feeding the sequence in chunks
    of `chunk_size` tokens (1 = the batched decode path; len = one whole prefill)."""
    runner = engine.runner
    req = Request("logits-probe", list(token_ids), SamplingParams(), seed=0)
    engine.block_manager.allocate(req, len(token_ids))
    runner.states[req.req_id] = SamplingState(SamplingParams(), 0, list(token_ids), len(token_ids))
    rows = []
    try:
        with torch.inference_mode():
            for start in range(0, len(token_ids), chunk_size):
                n = min(chunk_size, len(token_ids) - start)
                inputs = runner.prepare_inputs([ScheduledSeq(req.req_id, start, n, req.block_ids, False)])
                rows.append(runner.model.compute_logits(runner.forward(inputs)))  # a decode graph's, on a GPU
    finally:
        engine.block_manager.free_request(req)
        del runner.states[req.req_id]
    return torch.cat(rows)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max over tokens of ||ours - ref|| / ||ref|| (per-token rows)."""
    return float(((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
