"""A replica's decoding requests, stepped in bulk without losing exactness.

    Scheduler.running, as stepping would have it:   [ a  b  c  d | e  f ]
                                                      decoding      prefilling, just admitted
    in the simulator:       DecodeGroup [ a b c d ]   Scheduler.running [ e f ]

With one priority and no preemption, the real Scheduler gives every running decode its one token
before anything else in the step, in running order, and the decodes come first in that order (they
were admitted first). A decode's step changes what others can see in only three ways:

  schedule  at a block boundary (position % block_size == 0) it takes a block from the free queue
            (BlockManager.allocate(req, 1))
  update    when its last block fills ((position + 1) % block_size == 0) it publishes the block's
            hash (BlockManager.cache_full_blocks), if prefix caching is on
  update    at its last token it finishes (Scheduler.update: publish, free its blocks)

Otherwise it only counts up: one more computed token, one more output token. So the group leaves
its members stale and replays only those events, through the real BlockManager and Scheduler
calls, in the order stepping makes them: by step, the schedule phase (0) before the update phase
(1), then running order. A member's counters are brought up to date ("synced") when one of its
events runs, or when the group hands it back. The Scheduler meanwhile sees the rest of `running`
with its budgets reduced by the group's size (replica.py), so admission and prefill chunks still
go through the real Scheduler code.

A member keeps (position - step) % block_size for life, so members are bucketed by it: at step s
bucket (-s) % block_size allocates and bucket (-s - 1) % block_size publishes. Finishes wait in a
heap by step. Each bucket is in running order because members join in that order.
"""
from __future__ import annotations

import heapq

from shardserve.engine.interface import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from shardserve.engine.scheduler import Scheduler, max_num_tokens
from shardserve.sim.sim_request import SimRequest

SCHEDULE, UPDATE = 0, 1  # the two phases of a step, in order


class DecodeGroup:
    def __init__(self, scheduler: Scheduler, token_id: int):
        self.scheduler = scheduler
        self.blocks = scheduler.block_manager
        self.block_size = self.blocks.block_size
        self.token_id = token_id
        self._token = SampledToken(token_id)
        self.buckets: list[list[SimRequest]] = [[] for _ in range(self.block_size)]
        self.finishes: list[tuple[int, int, SimRequest]] = []  # (finish_step, arrival_seq, req)
        self.size = 0
        self.context_offset_sum = 0  # sum over members of decode_delta + 1: context at step s is s + delta + 1
        self.max_arrival_seq = -1  # of members since the group was last empty
        self.next_step, self.next_phase = 0, SCHEDULE  # the first event slot not yet replayed
        self.finished: list[SimRequest] = []  # finished by replayed events, for the replica to collect

    # --- membership ---------------------------------------------------------------------------------
    def context_sum(self, step: int) -> int:
        """Sum of the members' contexts (tokens attended, the new one included) at `step`."""
        return self.size * step + self.context_offset_sum

    @property
    def next_finish_step(self) -> int | None:
        return self.finishes[0][0] if self.finishes else None

    def can_join(self, req: SimRequest) -> bool:
        """A running request past its prompt, with exactly the blocks and published hashes that
        stepping gives a decode (so its events fall where the buckets say)."""
        computed = req.num_computed_tokens
        if computed != req.num_tokens - 1 or req.priority != 0:
            return False
        if len(req.block_ids) != self.blocks.blocks_needed(computed):
            return False
        return not self.blocks.enable_prefix_caching or req.num_published_blocks == computed // self.block_size

    def length_limit(self, req: SimRequest) -> int:
        """Tokens (prompt + output) at which `req` finishes: the Scheduler's own rule."""
        return max_num_tokens(len(req.prompt_token_ids), req.params.max_tokens, self.scheduler.max_model_len)

    def join(self, req: SimRequest, step: int) -> None:
        """Add a request that decodes from `step` on; the caller has replayed every event before
        `step` and removed it from Scheduler.running."""
        if (self.next_step, self.next_phase) != (step, SCHEDULE):
            raise RuntimeError(f"decode group: join at step {step}, events replayed to {self.next_step}")
        delta = req.num_computed_tokens - step
        # the update of step s leaves s + delta + 2 tokens, and finishes it at the scheduler's limit
        req.finish_step = self.length_limit(req) - 2 - delta
        req.decode_delta, req.group_first_step = delta, step
        self.buckets[delta % self.block_size].append(req)
        heapq.heappush(self.finishes, (req.finish_step, req.arrival_seq, req))
        self.size += 1
        self.context_offset_sum += delta + 1
        self.max_arrival_seq = max(self.max_arrival_seq, req.arrival_seq)

    def _leave(self, req: SimRequest) -> None:
        self.buckets[req.decode_delta % self.block_size].remove(req)
        self.size -= 1
        self.context_offset_sum -= req.decode_delta + 1
        if self.size == 0:
            self.max_arrival_seq = -1

    def release_all(self, step: int) -> list[SimRequest]:
        """Hand every member back, synced to the start of `step` (events before it replayed), in
        running order; the group is empty afterwards."""
        self.replay_through(step - 1, UPDATE)
        members = sorted((r for bucket in self.buckets for r in bucket), key=lambda r: r.arrival_seq)
        for req in members:
            self._sync_before(req, step)
            req.emitted_during(req.group_first_step, step - 1)
        self.buckets = [[] for _ in range(self.block_size)]
        self.finishes.clear()
        self.size, self.context_offset_sum, self.max_arrival_seq = 0, 0, -1
        return members

    # --- replaying events ---------------------------------------------------------------------------
    def allocations_in(self, first_step: int, num_steps: int) -> int:
        """Blocks the members take over steps [first_step, first_step + num_steps)."""
        bs = self.block_size
        full_cycles, rest = divmod(num_steps, bs)
        count = full_cycles * self.size
        start = first_step + full_cycles * bs
        return count + sum(len(self.buckets[(-s) % bs]) for s in range(start, start + rest))

    def max_steps_within(self, first_step: int, num_steps: int, num_free_blocks: int) -> int:
        """The most steps, up to `num_steps`, whose allocations fit in `num_free_blocks`."""
        if self.size * (num_steps // self.block_size + 1) <= num_free_blocks:  # plenty: no counting
            return num_steps
        if self.allocations_in(first_step, num_steps) <= num_free_blocks:
            return num_steps
        bs = self.block_size
        steps = min(num_steps, (num_free_blocks // self.size) * bs)  # whole cycles: size blocks each
        taken = self.allocations_in(first_step, steps)
        while steps < num_steps:
            taken += len(self.buckets[(-(first_step + steps)) % bs])
            if taken > num_free_blocks:
                break
            steps += 1
        return steps

    def replay_through(self, step: int, phase: int) -> None:
        """Replay every event slot up to and including (step, phase)."""
        s, end = self.next_step, step + 1 if phase == UPDATE else step  # steps [s, end) whole
        if (s, self.next_phase) > (step, phase):
            return
        if self.size:
            buckets, bs, blocks, finishes = self.buckets, self.block_size, self.blocks, self.finishes
            publishes = blocks.enable_prefix_caching
            if self.next_phase == UPDATE:  # finish a step whose schedule phase was replayed before
                if (finishes and finishes[0][0] == s) or (publishes and buckets[(-s - 1) % bs]):
                    self._update_phase(s)
                s += 1
            next_finish = finishes[0][0] if finishes else end
            allocate = blocks.allocate
            while s < end:
                for req in buckets[-s % bs]:
                    req.num_computed_tokens = s + req.decode_delta
                    allocate(req, 1)
                if s == next_finish or (publishes and buckets[(-s - 1) % bs]):
                    self._update_phase(s)
                    if not self.size:
                        break
                    next_finish = finishes[0][0] if finishes else end
                s += 1
            if s == step and phase == SCHEDULE and self.size:
                for req in buckets[-s % bs]:
                    req.num_computed_tokens = s + req.decode_delta
                    blocks.allocate(req, 1)
        self.next_step, self.next_phase = (step + 1, SCHEDULE) if phase == UPDATE else (step, UPDATE)

    def _update_phase(self, step: int) -> None:
        finishing = []
        while self.finishes and self.finishes[0][0] == step:
            finishing.append(heapq.heappop(self.finishes)[2])
        publishing = self.buckets[(-step - 1) % self.block_size] if self.blocks.enable_prefix_caching else []
        if not finishing:
            for req in publishing:
                self._sync_after(req, step)
                self.blocks.cache_full_blocks(req)
            return
        ending = {id(r) for r in finishing}
        ordered = sorted([*finishing, *(r for r in publishing if id(r) not in ending)], key=lambda r: r.arrival_seq)
        for req in ordered:
            if id(req) in ending:
                self._finish(req, step)
            else:
                self._sync_after(req, step)
                self.blocks.cache_full_blocks(req)

    def _finish(self, req: SimRequest, step: int) -> None:
        """The real Scheduler.update of its last step, on a one-sequence output."""
        self._leave(req)
        self._sync_before(req, step)
        self.scheduler.running.append(req)  # update() takes a finished request out of running
        position = req.num_computed_tokens
        sched = SchedulerOutput(seqs=[ScheduledSeq(req.req_id, position, 1, [], True)])
        self.scheduler.update(sched, ModelRunnerOutput({req.req_id: [self._token]}))
        if not req.is_finished:
            raise RuntimeError(f"decode group: {req.req_id} did not finish at step {step}")
        req.emitted_during(req.group_first_step, step)
        self.finished.append(req)

    def _sync_before(self, req: SimRequest, step: int) -> None:
        """Counters as at the start of `step`: `position` computed, position + 1 tokens in all."""
        position = step + req.decode_delta
        req.num_computed_tokens = position
        missing = position + 1 - req.num_tokens
        if missing > 0:
            req.output_token_ids += [self.token_id] * missing

    def _sync_after(self, req: SimRequest, step: int) -> None:
        """Counters as after the update of `step`."""
        self._sync_before(req, step + 1)
