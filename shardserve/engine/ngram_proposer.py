"""N-gram proposals (prompt lookup decoding): when a request's last n tokens occurred earlier in
its prompt or output, propose the tokens that followed them there. Edits, summaries and code
rewrites copy long runs of their prompt, so the model's next tokens are often those.

Each request keeps, for every n in [min_n, max_n], a map from an n-gram to the end of its latest
occurrence that has a token after it. Tokens are indexed as they arrive, so a proposal costs a
few dictionary lookups, not a scan of the context:

    tokens  a b c d x a b c
                  ^ "a b c" ended here, followed by "d x a b c"
    last 3 = "a b c"  ->  propose "d x a b" (k = 4)

The longest matching n wins; within one n the latest occurrence. Keys are the n-grams' hashes:
a collision only costs a rejected proposal, since the target model verifies every token.
Pure Python, no torch (the scheduler calls it).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Index:
    num_indexed: int = 0  # tokens[:num_indexed] have had their n-grams ending before them entered
    ends: dict[int, dict[int, int]] = field(default_factory=dict)  # n -> hash(n-gram) -> end position


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, req_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the request's prompt and output so far, only ever
        appended to between calls with the same req_id); [] when no n-gram matches."""
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = _Index(ends={n: {} for n in range(self.min_n, self.max_n + 1)})
        self._extend(index, tokens)
        num = len(tokens)
        for n in range(min(self.max_n, num), self.min_n - 1, -1):
            end = index.ends[n].get(hash(tuple(tokens[num - n:])))
            if end is not None:
                return tokens[end:end + k]
        return []

    def forget(self, req_id: str) -> None:
        self._indexes.pop(req_id, None)

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        # an n-gram ending at `end` is entered once tokens[end] exists (a continuation to propose)
        for end in range(max(index.num_indexed, 1), len(tokens)):
            for n, ends in index.ends.items():
                if end >= n:
                    ends[hash(tuple(tokens[end - n:end]))] = end
        index.num_indexed = max(index.num_indexed, len(tokens))
