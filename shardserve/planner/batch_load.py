"""A step's batch as the cost model counts it: the new tokens, attended (query, key) pairs, KV
entries read and sequences of a list of chunks or of a steady-state summary, and the share of it
the busiest data-parallel attention group holds."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardserve.config import ConfigError


def num_attended_pairs(num_tokens: int, context_len: int) -> int:
    """(query, key) pairs of a causal chunk: `num_tokens` new tokens ending a context of
    `context_len` tokens (new ones included). Token i of the chunk sees context_len - num_tokens + i
    keys: pairs = T * (C - T) + T * (T + 1) / 2. Decode (T = 1) gives C; a whole prompt
    (T = C) gives T(T+1)/2, the causal half of the square."""
    if num_tokens < 0 or context_len < num_tokens:
        raise ConfigError(f"need 0 <= num_tokens ({num_tokens}) <= context_len ({context_len})")
    return num_tokens * (context_len - num_tokens) + num_tokens * (num_tokens + 1) // 2



@dataclass(frozen=True)
class BatchSummary:
    """A step's batch in aggregate: one prompt chunk of `num_prefill_tokens` ending a context of
    `prefill_context_len` tokens, plus `num_decode_seqs` decodes at `decode_context_len` each.
    The planner passes steady-state means here, so the decode fields may be fractional."""

    num_prefill_tokens: int = 0
    prefill_context_len: int = 0
    num_decode_seqs: float = 0
    decode_context_len: float = 0


@dataclass(frozen=True)
class BatchLoad:
    num_tokens: float  # new tokens through the GEMMs
    num_pairs: float  # attended (query, key) pairs
    num_decode_pairs: float  # the part of num_pairs from one-token chunks (decodes)
    num_context_tokens: float  # KV entries read
    num_seqs: float  # rows that reach the LM head

    def split(self, num_parts: int) -> "BatchLoad":
        return BatchLoad(self.num_tokens / num_parts, self.num_pairs / num_parts, self.num_decode_pairs / num_parts,
                          self.num_context_tokens / num_parts, self.num_seqs / num_parts)


def chunks_load(chunks: Sequence[tuple[int, int]]) -> BatchLoad:
    return BatchLoad(
        num_tokens=sum(t for t, _ in chunks),
        num_pairs=sum(num_attended_pairs(t, c) for t, c in chunks),
        num_decode_pairs=sum(c for t, c in chunks if t == 1),
        num_context_tokens=sum(c for _, c in chunks),
        num_seqs=len(chunks),
    )


def busiest_group_load(batch: Sequence[tuple[int, int]] | BatchSummary, num_groups: int) -> BatchLoad:
    """What the most loaded of `num_groups` data-parallel attention groups holds. A sequence
    lives on one group (its KV is there), so a prompt chunk is never split: the engine balances
    whole sequences, here greedily by new tokens (largest first onto the lightest group). Every
    group waits for the others at each MoE layer, so this group sets the step's attention time.
    A BatchSummary's one prompt chunk sits on one group with that group's share of the decodes."""
    if isinstance(batch, BatchSummary):
        b = batch
        chunk = BatchSummary(b.num_prefill_tokens, b.prefill_context_len, b.num_decode_seqs / num_groups,
                             b.decode_context_len)
        return batch_load(chunk)
    groups: list[list[tuple[int, int]]] = [[] for _ in range(num_groups)]
    tokens = [0] * num_groups
    for chunk in sorted(batch, key=lambda tc: (tc[0], tc[1]), reverse=True):
        lightest = min(range(num_groups), key=lambda g: (tokens[g], len(groups[g])))
        groups[lightest].append(chunk)
        tokens[lightest] += chunk[0]
    loads = [chunks_load(g) for g in groups]
    return max(loads, key=lambda load: (load.num_tokens, load.num_context_tokens, load.num_seqs))


def batch_load(batch: Sequence[tuple[int, int]] | BatchSummary) -> BatchLoad:
    if isinstance(batch, BatchSummary):
        b = batch
        prefill_seqs = 1 if b.num_prefill_tokens else 0
        prefill_pairs = num_attended_pairs(b.num_prefill_tokens, b.prefill_context_len) if prefill_seqs else 0
        return BatchLoad(
            num_tokens=b.num_prefill_tokens + b.num_decode_seqs,
            num_pairs=prefill_pairs + b.num_decode_seqs * b.decode_context_len,
            num_decode_pairs=b.num_decode_seqs * b.decode_context_len,
            num_context_tokens=prefill_seqs * b.prefill_context_len + b.num_decode_seqs * b.decode_context_len,
            num_seqs=prefill_seqs + b.num_decode_seqs,
        )
    return chunks_load(batch)


def step_loads(batch: Sequence[tuple[int, int]] | BatchSummary, num_groups: int) -> tuple[BatchLoad, BatchLoad]:
    """(the whole step's load, the busiest of `num_groups` attention groups' load); one and the
    same without data-parallel attention."""
    whole = batch_load(batch)
    return whole, (whole if num_groups <= 1 else busiest_group_load(batch, num_groups))
