"""Token sampling: penalties, grammar masks, temperature, top-k / top-p / min-p, seeded draws,
logprobs.

A draw is a pure function of (seed, position, logits): one uniform number `u` is hashed from
(seed, position) and the token is where `u` falls on the row's cumulative distribution (inverse
transform sampling, exact). It does not depend on which other requests share the batch, how many
steps came before, or on which replica it runs. One number per row, not a noise vector over the
vocabulary: a whole batch's draws are one cumsum and one searchsorted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.engine.grammar import apply_token_bitmask
from shardserve.engine.interface import SampledToken
from shardserve.layers.cpu_kernels import argmax_rows
from shardserve.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive (seed, position) pairs apart


@dataclass
class SamplingState:
    """What the sampler needs to know about one request, kept by the model runner."""

    params: SamplingParams
    seed: int
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    matcher: object | None = None  # the grammar's state, with structured outputs (engine/grammar.py)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def draw_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ position) % (2**63 - 1)


def draw_uniform(seed: int, position: int) -> float:
    """u in [0, 1) from the top 53 bits of a 64-bit mix of (seed, position) (splitmix64's finalizer)."""
    x = draw_seed(seed, position)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) / 2.0**53


def argmax_suffices(states: list[SamplingState]) -> bool:
    """Whether `sample` would answer every state with the raw logits' argmax and nothing else
    (greedy, no penalties, no min_tokens still to reach, no logprobs, no grammar): the LM head can
    then pick the tokens without materializing the logits."""
    return all(s.params.is_greedy and not s.params.has_penalties and s.num_output_tokens >= s.params.min_tokens
               and s.params.logprobs is None and s.params.structured_outputs is None for s in states)


def sample(logits: torch.Tensor, states: list[SamplingState], bitmask: torch.Tensor | None = None) -> list[SampledToken]:
    """logits: [N, vocab] float32, row i for states[i]; each state's next token goes at
    position len(state.token_ids). `bitmask` ([N, words] int32, engine/grammar.py) holds the
    tokens each row's grammar allows (all ones for a row without one). Returns one SampledToken
    per row; logprobs are those of the raw logits, as vLLM reports them by default."""
    raw_logits = logits
    if bitmask is not None or any(s.params.has_penalties or s.num_output_tokens < s.params.min_tokens for s in states):
        logits = logits.clone()
        for row, state in enumerate(states):
            _apply_penalties(logits[row], state)
            if state.params.structured_outputs is None:  # a grammar decides when its output may end
                _mask_early_stop(logits[row], state)
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
    token_ids = argmax_rows(logits)
    random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = _probabilities(logits[index], [states[i].params for i in random_rows])
        cdf = probs.double().cumsum(dim=-1)  # float64: 49k float32 partial sums would drift
        u = torch.tensor([draw_uniform(states[i].seed, len(states[i].token_ids)) for i in random_rows],
                         dtype=torch.float64, device=logits.device).unsqueeze(1)
        # the first token whose cumulative mass exceeds u * total; a zero-probability token never
        # is one (the cdf does not rise there)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)
        token_ids[index] = drawn.squeeze(1)
    tokens = [SampledToken(int(t)) for t in token_ids.tolist()]
    logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if logprob_rows:
        _attach_logprobs(raw_logits, tokens, states, logprob_rows)
    return tokens


def _apply_penalties(logits: torch.Tensor, state: SamplingState) -> None:
    params = state.params
    if params.repetition_penalty != 1:  # HF / CTRL style, over prompt and output tokens
        seen = torch.tensor(sorted(set(state.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and state.num_output_tokens:
        counts = _output_counts(state)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= params.frequency_penalty * freq + params.presence_penalty


def _output_counts(state: SamplingState) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in state.token_ids[state.num_prompt_tokens :]:
        counts[t] = counts.get(t, 0) + 1
    return counts


def _mask_early_stop(logits: torch.Tensor, state: SamplingState) -> None:
    """Below min_tokens, EOS and stop tokens cannot be sampled."""
    if state.num_output_tokens >= state.params.min_tokens:
        return
    banned = set(state.params.stop_token_ids)
    if not state.params.ignore_eos:
        banned |= set(state.eos_token_ids)
    if banned:
        logits[torch.tensor(sorted(banned), dtype=torch.long, device=logits.device)] = float("-inf")


# top-p looks for its nucleus among the most likely 256 tokens, then 4,096, before sorting the
# whole vocabulary: on a CPU a sort of 49k entries costs ~2 ms a row, a top-256 ~0.1 ms
_TOP_P_CANDIDATES = (256, 4096)


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, vocab] logits -> probabilities after temperature, top-k, top-p and min-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        logits = _keep_top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device).unsqueeze(1)
    if (top_p < 1).any():
        probs = _keep_top_p(probs, top_p)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _keep_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask all but each row's k largest logits (ties with the k-th kept); k <= 0: keep all."""
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else 1 for k in top_k], device=logits.device)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth[torch.tensor([k <= 0 for k in top_k], device=logits.device)] = float("-inf")
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep a token if the mass strictly before it, most likely first, is below its row's top_p
    (the top token always stays). The nucleus is sought among the top candidates, more of them
    for rows whose candidates hold less than top_p (flat distributions), the whole row last.
    Every way gives the same partial sums: a cumulative sum's first n terms do not depend on
    what follows."""
    out = torch.zeros_like(probs)
    rows = torch.arange(probs.shape[0], device=probs.device)
    for num in (*_TOP_P_CANDIDATES, probs.shape[-1]):
        num = min(num, probs.shape[-1])
        values, order = probs[rows].topk(num, dim=-1) if num < probs.shape[-1] else probs[rows].sort(
            dim=-1, descending=True)
        mass_before = values.cumsum(dim=-1) - values
        # found: the first token left out has at least top_p before it, so none after it counts
        found = (mass_before[:, -1] + values[:, -1] >= top_p[rows, 0]) | (num == probs.shape[-1])
        kept = values[found].masked_fill(mass_before[found] >= top_p[rows[found]], 0.0)
        out[rows[found]] = torch.zeros_like(probs[rows[found]]).scatter_(1, order[found], kept)
        rows = rows[~found]
        if not len(rows):
            break
    return out


def _attach_logprobs(logits, tokens: list[SampledToken], states, rows: list[int]) -> None:
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)
    vocab_size = logits.shape[-1]
    wanted = [vocab_size if states[i].params.logprobs == -1 else states[i].params.logprobs for i in rows]
    top_values, top_ids = logprobs.topk(max(max(wanted), 1), dim=-1)
    for j, (row, n) in enumerate(zip(rows, wanted)):
        tokens[row].logprob = float(logprobs[j, tokens[row].token_id])
        tokens[row].top_logprobs = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist()))
