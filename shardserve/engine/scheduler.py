"""Continuous batching under a token budget, with chunked prefill, prefix caching, priorities and
preemption by recompute. Pure Python: imports no torch.

Each step::

    budget = max_num_batched_tokens
    1. running requests, best priority first: each gets its next chunk (1 token when decoding);
       when blocks run out, preempt the worst-priority running request (free its blocks, send it
       back to waiting, recompute later) until the chunk fits
    2. if nothing was preempted: admit waiting requests, best first, while budget, blocks and
       max_num_seqs allow; a waiting request starts from its longest cached prefix
    Running requests of a worse priority than the best waiting request wait until after step 2,
    and sit the step out if it admitted anyone: so batch-class decodes never slow the step that
    starts an interactive request (with one priority, as by default, nothing changes).

A request's chunk is `min(remaining tokens, budget left, max_prefill_chunk_tokens)`, so long
prompts are split over several steps and mixed with other requests' decodes. With a Speculator
(engine/speculator.py), a decoding request's chunk is its last token plus the tokens proposed
for it, when budget and blocks allow; `update` keeps the KV of the proposals that held.
"""
from __future__ import annotations

import bisect
import itertools
import time

from shardserve.config import SchedulerConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.interface import ModelRunnerOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from shardserve.engine.speculator import Speculator
from shardserve.request import FinishReason, Request, RequestStatus


def max_num_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The stop rule's length limit: a request finishes (FinishReason.LENGTH) once it holds this
    many tokens, prompt and output together, at its max_tokens or at the context window, whichever
    comes first. Pure, so the simulator plans finishes with it (sim/decode_group.py)."""
    return min(prompt_len + max_tokens, max_model_len)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0

    # --- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        req.arrival_seq = next(self._arrivals)
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def finish_request(self, req_id: str, reason: FinishReason, stop_reason=None) -> Request | None:
        """End a request (abort, or a stop string seen by the detokenizer) and free its blocks."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
        self._finish(req, reason, stop_reason)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens
        # Running requests of a worse priority than the best waiting one step aside while it is
        # admitted: the step that prefills an interactive request carries no batch decodes.
        urgent = self.waiting[0].priority if self.waiting else None
        first = [r for r in self.running if urgent is None or r.priority <= urgent]
        later = [r for r in self.running if urgent is not None and r.priority > urgent]
        drafts = self._proposals()
        if self.speculator is not None:
            out.num_draft_tokens = self.speculator.num_draft_tokens
            out.num_draft_requests = self.speculator.num_draft_requests
        budget, preempted = self._schedule_running(out, first, budget, drafts)
        if not preempted:
            num_admitted = len(out.new_requests)
            budget = self._admit_waiting(out, budget)
            if len(out.new_requests) > num_admitted:
                return out
        self._schedule_running(out, later, budget, drafts)
        return out

    def _proposals(self) -> dict[str, list[int]]:
        """The speculator's proposals for running requests that decode this step."""
        if self.speculator is None:
            return {}
        decoding = [(r, self._max_tokens(r) - r.num_tokens - 1) for r in self.running
                    if r.num_tokens - r.num_computed_tokens == 1]
        return self.speculator.propose(decoding, len(self.running)) if decoding else {}

    def _max_tokens(self, req: Request) -> int:
        return max_num_tokens(len(req.prompt_token_ids), req.params.max_tokens, self.max_model_len)

    def _schedule_running(self, out: SchedulerOutput, reqs: list[Request], budget: int,
                          drafts: dict[str, list[int]]) -> tuple[int, bool]:
        """Give each of `reqs` (running, best first) its next chunk; (budget left, preempted?)."""
        preempted = False
        for req in reqs:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            spec = drafts.get(req.req_id, [])[: budget - 1]
            if spec and self.block_manager.can_allocate(req, 1 + len(spec)):  # never preempt for proposals
                self._allocate(req, 1 + len(spec), sample=True)
                out.seqs.append(self._scheduled(req, 1 + len(spec), spec))
                budget -= 1 + len(spec)
                continue
            num_new = self._chunk_size(req, budget)
            while not self.block_manager.can_allocate(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preemptions += 1
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            self._allocate(req, num_new, sample=req.num_computed_tokens + num_new == req.num_tokens)
            out.seqs.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget, preempted

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.block_manager.find_prefix(req) if req.num_computed_tokens == 0 else []
            num_new = self._chunk_size(req, budget, num_skipped=len(hits) * self.block_manager.block_size)
            if not self.block_manager.can_allocate(req, num_new, hits):
                break
            self.waiting.pop(0)
            num_hit_tokens = len(hits) * self.block_manager.block_size
            if req.num_computed_tokens == 0:
                self.block_manager.record_prefix_lookup(req.num_tokens, num_hit_tokens)
            self._allocate(req, num_new, req.num_computed_tokens + len(hits) * self.block_manager.block_size
                           + num_new == req.num_tokens, hits)
            if req.num_preemptions == 0 and not req.output_token_ids:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            out.new_requests.append(
                NewRequestData(req.req_id, req.all_token_ids, req.params, req.seed, len(req.prompt_token_ids))
            )
            out.seqs.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget

    def _allocate(self, req: Request, num_new: int, sample: bool, hits: list[int] = ()) -> None:
        """Blocks for the chunk, and for a chunk that samples the speculator's lookahead slots
        too when the pool has them free (they never preempt anyone)."""
        extra = self.speculator.lookahead if self.speculator is not None and sample else 0
        if extra and self.block_manager.can_allocate(req, num_new + extra, hits):
            num_new += extra
        self.block_manager.allocate(req, num_new, hits)

    def _chunk_size(self, req: Request, budget: int, num_skipped: int = 0) -> int:
        remaining = req.num_tokens - req.num_computed_tokens - num_skipped
        limit = self.config.max_prefill_chunk_tokens or remaining
        return max(1, min(remaining, budget, limit))

    def _scheduled(self, req: Request, num_new: int, spec: list[int] = ()) -> ScheduledSeq:
        start = req.num_computed_tokens
        sample = start + num_new - len(spec) == req.num_tokens
        return ScheduledSeq(req.req_id, start, num_new, list(req.block_ids), sample, list(spec))

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, wait again."""
        self.running.remove(req)
        self.block_manager.free_request(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self._finished_since_last_step.append(req.req_id)  # the runner drops its stale state
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    # --- after the model ran -------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens and finish requests that hit a stop
        condition. Returns the requests that got new tokens this step. A verified chunk keeps the
        KV of the proposals that held; tokens after one that stops the request are dropped from
        `result.sampled` too, so it holds what each request kept."""
        updated = []
        if result.proposals is not None:
            self.speculator.keep_drafts(result.proposals)
        for seq in sched.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            sampled = result.sampled.get(seq.req_id)
            num_rejected = 0
            if seq.spec_token_ids:
                num_accepted = len(sampled) - 1
                num_rejected = len(seq.spec_token_ids) - num_accepted
                self.speculator.record(len(seq.spec_token_ids), num_accepted)
            req.num_computed_tokens = seq.start_pos + seq.num_tokens - num_rejected
            if sampled:
                for i, token in enumerate(sampled):
                    req.output_token_ids.append(token.token_id)
                    self._check_stop(req, token.token_id)
                    if req.is_finished:
                        del sampled[i + 1:]
                        break
                updated.append(req)
            if not req.is_finished:
                self.block_manager.cache_full_blocks(req)
        return updated

    def _check_stop(self, req: Request, token_id: int) -> None:
        params = req.params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return self._finish_running(req, FinishReason.STOP, None)
            if token_id in params.stop_token_ids:
                return self._finish_running(req, FinishReason.STOP, token_id)
        if req.num_tokens >= self._max_tokens(req):
            self._finish_running(req, FinishReason.LENGTH, None)

    def _finish_running(self, req: Request, reason: FinishReason, stop_reason) -> None:
        self.running.remove(req)
        del self.requests[req.req_id]
        self._finish(req, reason, stop_reason)

    def _finish(self, req: Request, reason: FinishReason, stop_reason) -> None:
        if req.status == RequestStatus.RUNNING:  # keep its computed blocks findable
            self.block_manager.cache_full_blocks(req)
        self.block_manager.free_request(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finished_time = time.monotonic()
        self._finished_since_last_step.append(req.req_id)
        if self.speculator is not None:
            self.speculator.forget(req.req_id)
