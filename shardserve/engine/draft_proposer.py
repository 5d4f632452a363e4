"""Draft-model proposals: a smaller model that shares the target's tokenizer guesses each
request's next tokens, greedily, after every step; the next step verifies them.

The draft has its own KV cache with the target's block count and block size, so a request's
block table indexes both: the scheduler allocates the blocks, the draft writes its keys and
values in the same slots of its own tensors (vLLM does the same). What the draft's cache holds
is tracked per request as the tokens it was computed from, so after a verification only the
positions past the first rejected proposal are recomputed:

    tokens   t0 .. t(n-1)                 (the request after this step; t(n-1) is new)
    draft    catch up on t(v) .. t(n-1)   one chunk, v = the first position whose KV is stale
             -> p1, then p1 -> p2, ...    one-token steps, batched over the requests

A preempted or finished request's entry is dropped (its blocks may go to another request); a
prefix-cache hit is recomputed by the draft, which writes the same values the target's earlier
request left there (the kernels give a token the same bits in any batch). Proposals stop where
the block table ends: the scheduler allocates `num_speculative_tokens` slots ahead when it can.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.config import ConfigError, EngineConfig
from shardserve.engine.kv_cache import KVCache
from shardserve.layers.attention.backend import AttentionBackend
from shardserve.layers.attention.paged_kv import SeqSpan


@dataclass
class DraftRequest:
    """One request to propose for: its tokens so far and its block table."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


class DraftProposer:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, attention: AttentionBackend, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        # req_id -> (the tokens its draft KV was computed from, how many of them are known to be
        # the request's own: all the tokens it had at the previous call, not the guesses after)
        self._cached: dict[str, tuple[list[int], int]] = {}

    def forget(self, req_id: str) -> None:
        self._cached.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_tokens: int) -> dict[str, list[int]]:
        """Up to `num_tokens` greedy guesses for each request's next tokens."""
        block_size = self.kv_cache.block_size
        live = []  # (request, tokens in the draft KV before this call, proposals allowed)
        for req in requests:
            capacity = len(req.block_ids) * block_size
            # proposal j (1-based) is computed from a forward at position n + j - 2
            allowed = min(num_tokens, capacity - len(req.token_ids) + 1)
            if allowed > 0:
                live.append((req, self._valid_prefix(req), allowed))
        if not live:
            return {}
        spans = [SeqSpan(valid, len(req.token_ids) - valid, req.block_ids) for req, valid, _ in live]
        inputs = [t for (req, valid, _) in live for t in req.token_ids[valid:]]
        guesses = self._step(inputs, spans)
        proposals = {req.req_id: [g] for (req, _, _), g in zip(live, guesses)}
        for req, _, _ in live:
            self._cached[req.req_id] = (list(req.token_ids), len(req.token_ids))
        for j in range(1, num_tokens):  # the next guess from the previous one, one token each
            batch = [(req, proposals[req.req_id]) for req, _, allowed in live if allowed > j]
            if not batch:
                break
            spans = [SeqSpan(len(req.token_ids) + j - 1, 1, req.block_ids) for req, _ in batch]
            guesses = self._step([props[-1] for _, props in batch], spans, num_decodes=len(batch))
            for (req, props), guess in zip(batch, guesses):
                self._cached[req.req_id][0].append(props[-1])
                props.append(guess)
        return proposals

    def _valid_prefix(self, req: DraftRequest) -> int:
        """How many leading tokens of the request the draft KV was computed from (a request's
        tokens are only ever appended to, so only those past the last call's are compared)."""
        cached, valid = self._cached.get(req.req_id, ([], 0))
        n = min(len(cached), len(req.token_ids) - 1)  # the newest token is never in it yet
        valid = min(valid, n)
        while valid < n and cached[valid] == req.token_ids[valid]:
            valid += 1
        return valid

    def _step(self, token_ids: list[int], spans: list[SeqSpan], num_decodes: int = 0) -> list[int]:
        """One forward of the draft over the spans (decodes first); the greedy token after each."""
        positions = [p for s in spans for p in range(s.start_pos, s.start_pos + s.num_tokens)]
        last_rows, row = [], -1
        for s in spans:
            row += s.num_tokens
            last_rows.append(row)
        meta = self.attention.build_metadata(spans, num_decodes, self.kv_cache)
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), self.kv_cache.layers, meta, None)
        hidden = hidden[self._tensor(last_rows)]
        greedy = self.model.compute_greedy(hidden)
        if greedy is None:
            greedy = self.model.compute_logits(hidden).argmax(dim=-1)
        return greedy.tolist()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def load_draft(config: EngineConfig, target) -> DraftProposer:
    """The draft model of `config.speculative` (its checkpoint loaded like the target's), with a
    KV cache of the target's blocks. `target` is the target's LoadedModel."""
    from shardserve.engine.model_loader import load_model

    spec = config.speculative
    draft_config = EngineConfig(model=spec.model, dtype=config.dtype, device=config.device,
                                max_model_len=target.max_model_len, show_progress=False,
                                skip_tokenizer_init=True, cache=config.cache, deterministic=config.deterministic,
                                quantization=spec.quantization)
    draft = load_model(draft_config, kv_num_blocks=target.kv_cache.num_blocks)
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        raise ConfigError(f"the draft model {spec.model!r} has a vocabulary of {draft.model_config.vocab_size} tokens, "
                          f"the target {target.model_config.vocab_size}: a draft must share the target's tokenizer")
    return DraftProposer(draft.model, draft.kv_cache, draft.attention, draft.device)
