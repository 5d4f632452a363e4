"""Speculative decoding, the scheduler's side: which decoding requests carry proposed tokens this
step, and what became of them.

    schedule:  drafts = speculator.propose(decoding requests)   n-gram lookup now, or the draft
                                                                model's guesses from the last step;
                                                                the policy picks how many to verify
    runner:    the target model computes [last token, d_1 .. d_k] as one chunk and samples every
               row; d_j is kept while it equals the token sampled before it (model_runner.py);
               a draft model then guesses the next step's (draft_proposer.py)
    update:    speculator.record(k, accepted)                    acceptance statistics

Verification samples each row exactly as plain decoding would sample that position (the draw
is a function of seed and position, engine/sampler.py), and a chunk's rows come out of the
model bit for bit as one-token steps would (the engine's batch invariance). So a request's
tokens are the same with speculation on or off, greedy or seeded, and the router's exact resume
holds. With a proposer that puts all its mass on one token, as n-gram lookup and a greedy draft
do, accepting d_j when it equals the target's sample is standard rejection sampling: accepted
with probability p(d_j), and on rejection the token drawn is the target's own sample.

Requests with structured outputs get no proposals: their grammar state would have to be rolled
back past a rejected token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.config import SpeculativeConfig
from shardserve.engine.interface import SampledToken
from shardserve.engine.ngram_proposer import NgramProposer
from shardserve.engine.speculation_policy import SpeculationPolicy
from shardserve.request import Request


def accept_proposals(rows: list[SampledToken], drafts: list[int]) -> list[SampledToken]:
    """A verified chunk's tokens: row j is the target's sample after the first j proposals;
    proposal j holds when it equals row j - 1 (the token the target put there), and the rows up
    to the first that differs are kept: 1 + (number of proposals that held) tokens."""
    kept = rows[:1]
    for draft, row in zip(drafts, rows[1:]):
        if kept[-1].token_id != draft:
            break
        kept.append(row)
    return kept


@dataclass
class SpeculationStats:
    """Totals since start, under vLLM's metric names (vllm:spec_decode_*)."""

    num_drafts: int = 0  # verifications, one per request and step that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Proposals come from n-gram lookup, made here at schedule time, or from a draft model,
    made by the runner after each step (`ModelRunnerOutput.proposals`) and kept here for the
    next; the policy decides how many of them a step verifies, and for a draft model also how
    many the runner proposes after it (`SchedulerOutput.num_draft_tokens`)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if config.method == "ngram" else None
        self.policy = SpeculationPolicy(config.num_speculative_tokens)
        self._drafted: dict[str, list[int]] = {}  # a draft model's proposals for the next step
        self.num_draft_tokens = 0  # how many the draft model proposes after this step
        self.num_draft_requests: int | None = None  # for how many requests (None: all)
        self.clear_stats()

    @property
    def lookahead(self) -> int:
        """KV slots a sampling request needs past its chunk: where a draft model computes its
        guesses after the step."""
        return 0 if self.ngram else self.config.num_speculative_tokens

    def clear_stats(self) -> None:
        self.stats = SpeculationStats(accepted_per_position=[0] * self.config.num_speculative_tokens)

    def propose(self, decoding: list[tuple[Request, int]], num_running: int) -> dict[str, list[int]]:
        """Proposals for this step: `decoding` holds each running request whose next chunk is
        one token, with the most tokens it may still generate after that one. Returns
        req_id -> proposed tokens for the requests that carry some (none when the policy says so)."""
        self.num_draft_tokens, self.num_draft_requests = 0, None
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return {}
        k = self.config.num_speculative_tokens
        proposals = {}
        for req, room in decoding:
            if req.params.structured_outputs is None and room > 0:
                proposal = (self.ngram.propose(req.req_id, req.all_token_ids, min(k, room)) if self.ngram
                            else self._drafted.get(req.req_id, [])[:room])
                if proposal:
                    proposals[req.req_id] = proposal
        if self.ngram and not proposals:
            return {}
        if self.config.policy == "auto":
            # a draft model can always propose: the policy weighs k of them, and its answer also
            # says how many the runner proposes for the next step
            lengths = [len(proposals.get(req.req_id, ())) if self.ngram else k for req, _ in decoding]
            k = self.policy.num_drafts(lengths)
        if not self.ngram:
            # a draft catches up on every token it skipped, so a probe asks it for one request's
            # guesses (asking for every request's cost a busy server whole-context prefills of
            # the draft, most of them then dropped: 42% of an offline batch-64 run's time)
            self.num_draft_tokens = k
            self.num_draft_requests = 1 if self.policy.probing else None
        return {req_id: p[:k] for req_id, p in proposals.items()} if k else {}

    def keep_drafts(self, proposals: dict[str, list[int]]) -> None:
        """The draft model's proposals after a step, for the next one."""
        self._drafted = proposals

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.stats.accepted_per_position[j] += 1
        self.policy.observe_verification(num_drafted, num_accepted)

    def observe_step(self, num_tokens: int, decode_only: bool, duration_s: float) -> None:
        self.policy.observe_step(num_tokens, decode_only, duration_s)
        self.policy.end_step()

    def forget(self, req_id: str) -> None:
        if self.ngram:
            self.ngram.forget(req_id)
        self._drafted.pop(req_id, None)
