"""A simulated replica: the engine's own Scheduler and BlockManager, the cost model as its clock.

The real engine loop is: take in the requests that arrived, schedule, run the model, update, emit
the sampled tokens at the end of the step, repeat while there is work. Here "run the model" is the
StepClock's duration and one fake sampled token per sampling sequence (workloads ignore EOS, so a
request's length is its max_tokens, exactly). Steps are numbered; every request remembers the steps
at which it emitted (sim_request.py) and `step_end_s` holds when each step ended.

The replica plans its next steps at once (one wake-up for the lot), as one of (D = the decode
group, decode_group.py):

    decode run    only decodes and nothing to admit: k steps, up to the next finish
    mixed (+ run) D's decodes plus prefill chunks or admissions: the real Scheduler.schedule() on
                  the rest of `running`, its token and sequence budgets less |D|; when that step
                  completes every prompt it schedules and leaves nothing waiting, the decode run
                  that follows is planned with it (the new decodes joining D after it)
    plain         the real schedule() on everything, D handed back first: whenever a block could
                  run out (preemption) or a preempted request is waiting to come back

An arrival cuts a plan after the step in flight (it joins the Scheduler between steps, as in the
engine loop). D replays its block events lazily. All of it leaves the Scheduler and BlockManager
exactly as stepping one by one would (tests/sim/test_fast_path.py).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
from array import array
from dataclasses import dataclass

from shardserve.config import SchedulerConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.interface import ModelRunnerOutput, SampledToken, SchedulerOutput
from shardserve.engine.scheduler import Scheduler
from shardserve.router.replica_pool import LoadSignals
from shardserve.sim.decode_group import SCHEDULE, UPDATE, DecodeGroup
from shardserve.sim.sim_request import SimRequest
from shardserve.sim.step_clock import StepClock

FAKE_TOKEN_ID = 0  # what the simulated model samples; never a stop token (workloads ignore EOS)
_FAKE_TOKEN = SampledToken(FAKE_TOKEN_ID)  # only read, so one serves every sequence


class PlanKind(enum.StrEnum):
    """How a plan's first step was taken (the module docstring); a plan's later steps are all
    decode-run steps. A str enum: num_steps_by_kind["run"] reads as before."""

    RUN = "run"
    MIXED = "mixed"
    PLAIN = "plain"


@dataclass(frozen=True)
class ReplicaSetup:
    """What every replica of a simulated fleet is: the engine's scheduler limits and KV cache, and
    the server's bound on unscheduled requests (beyond it: HTTP 429)."""

    scheduler: SchedulerConfig
    num_kv_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    max_waiting_requests: int = 256
    max_run_steps: int = 4096  # longest decode run taken at once
    fast_path: bool = True  # False: a plain step at a time (the reference the fast path is tested against)


class SimReplica:
    def __init__(self, index: int, setup: ReplicaSetup, clock: StepClock):
        self.index = index
        self.setup = setup
        self.clock = clock
        self.blocks = BlockManager(setup.num_kv_blocks, setup.block_size, setup.enable_prefix_caching)
        self.scheduler = Scheduler(setup.scheduler, self.blocks, setup.max_model_len)
        self.group = DecodeGroup(self.scheduler, FAKE_TOKEN_ID)
        self.step = 0  # number of the next step to plan
        self.step_end_s = array("d")  # end time of every finished step
        self.pending: list[SimRequest] = []  # arrived during the step in flight
        self.finished: list[SimRequest] = []  # since the caller last collected them
        self.busy = False
        self.wake_s = 0.0  # end of the plan in flight
        self.version = 0  # bumped when wake_s moves (stale wake-ups are ignored)
        # The plan in flight: steps self.step .. self.step + len(_ends) - 1 end at _ends; the first
        # is a scheduled step (`_sched`, until applied) or the first of a decode run.
        self._ends: list[float] = []
        self._sched: SchedulerOutput | None = None
        self._first_kind = PlanKind.RUN
        self._configs: dict[int, SchedulerConfig] = {}
        self.num_steps_by_kind = {kind: 0 for kind in PlanKind}  # steps taken each way
        self._gauges: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, KV usage after the last step
        self.keep_gauges = True  # False when nobody scrapes them (no router, or one that ignores load)

    # --- requests in ------------------------------------------------------------------------------
    def num_unscheduled(self) -> int:
        return len(self.scheduler.waiting) + len(self.pending)

    def submit(self, req: SimRequest, now: float) -> bool:
        """A request reaches the server at `now`. False (HTTP 429) when too many are unscheduled,
        like AsyncEngine.submit. Otherwise it joins the Scheduler after the step in flight (the
        plan is cut there), or at once when idle."""
        if self.num_unscheduled() + 1 > self.setup.max_waiting_requests:
            return False
        if not self.busy:
            self.scheduler.add_request(req)
            self._start(now)
            return True
        self.pending.append(req)
        ends = self._ends
        in_flight = bisect.bisect_left(ends, now)  # the first step ending at or after now
        if in_flight < len(ends) - 1:
            del ends[in_flight + 1:]
            self.wake_s = ends[in_flight]
            self.version += 1
        return True

    # --- the plan in flight ends --------------------------------------------------------------------
    def wake(self, now: float) -> None:
        """The plan in flight ended at `now`: apply it, take in arrivals, plan the next steps."""
        if self._sched is not None:
            self._apply_first_step()
        ends = self._ends
        self.num_steps_by_kind[self._first_kind] += 1
        self.num_steps_by_kind[PlanKind.RUN] += len(ends) - 1
        self.step_end_s.extend(ends)
        self.step += len(ends)
        self._ends = []
        self.group.replay_through(self.step - 1, UPDATE)
        if self.group.finished:
            self.finished += self.group.finished
            self.group.finished = []
        self._join_decodes(self.step)
        if self.keep_gauges:
            self._gauges = (self.group.size + len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage)
        for req in self.pending:
            self.scheduler.add_request(req)
        self.pending = []
        self._start(now)

    def _apply_first_step(self) -> None:
        """The update of the plan's scheduled first step (after the decodes' own, in running order);
        with a decode run planned after it, its new decodes join the group for that run."""
        sched, self._sched, step = self._sched, None, self.step
        self.group.replay_through(step, UPDATE)
        result = ModelRunnerOutput({s.req_id: [_FAKE_TOKEN] for s in sched.seqs if s.sample})
        for req in self.scheduler.update(sched, result):
            req.emitted_at(step)
            if req.is_finished:
                self.finished.append(req)
        if len(self._ends) > 1:
            self._join_decodes(step + 1)
            if self.scheduler.running:
                raise RuntimeError(f"replica {self.index}: step {step} left prefills the planned decode run lacks")

    def _join_decodes(self, step: int) -> None:
        """Move the decoding requests at the front of `running` into the decode group from `step` on."""
        if not self.setup.fast_path:
            return
        running, group = self.scheduler.running, self.group
        num = 0
        while num < len(running) and running[num].arrival_seq > group.max_arrival_seq and group.can_join(running[num]):
            num += 1
        if num:
            joining = running[:num]
            del running[:num]
            for req in joining:
                group.join(req, step)

    # --- the next plan -----------------------------------------------------------------------------
    def _start(self, now: float) -> None:
        scheduler, group = self.scheduler, self.group
        if not scheduler.requests:
            self.busy = False
            return
        self.busy = True
        if not self.setup.fast_path:
            return self._start_plain(now)
        limits = self.setup.scheduler
        num_running = group.size + len(scheduler.running)
        admissible = bool(scheduler.waiting) and num_running < limits.max_num_seqs
        if not scheduler.running and not admissible and group.size <= limits.max_num_batched_tokens:
            num_steps = min(group.next_finish_step - self.step + 1, self.setup.max_run_steps)
            num_steps = group.max_steps_within(self.step, num_steps, self.blocks.num_free_blocks)
            if num_steps >= 1:
                self._first_kind = PlanKind.RUN
                return self._plan(self._decode_ends(now, group.size, group.context_offset_sum, self.step, num_steps))
        elif self._mixed_is_exact():
            return self._start_mixed(now)
        self._start_plain(now)

    def _plan(self, ends: list[float]) -> None:
        self._ends = ends
        self.wake_s = ends[-1]
        self.version += 1

    def _mixed_is_exact(self) -> bool:
        """Whether hiding the decode group from schedule() changes nothing: waiting requests come
        after every member in running order (no preempted one coming back), the members' tokens fit
        the budget, and no block can run out this step (no preemption)."""
        scheduler, group = self.scheduler, self.group
        if scheduler.waiting and scheduler.waiting[0].arrival_seq < group.max_arrival_seq:
            return False
        if group.size > self.setup.scheduler.max_num_batched_tokens:
            return False
        blocks = self.blocks
        need = len(group.buckets[(-self.step) % blocks.block_size])
        need += sum(blocks.blocks_needed(r.num_tokens) - len(r.block_ids) for r in scheduler.running)
        return need <= blocks.num_free_blocks

    def _decode_ends(self, start_s: float, num_decodes: int, offset_sum: int, first_step: int,
                     num_steps: int) -> list[float]:
        """End times of `num_steps` decode steps from `first_step`, at `num_decodes` sequences whose
        contexts at step s sum to num_decodes * s + offset_sum (clock.decode_ends)."""
        return self.clock.decode_ends(start_s, num_decodes, num_decodes * first_step + offset_sum, num_steps)

    def _start_mixed(self, now: float) -> None:
        group, scheduler = self.group, self.scheduler
        group.replay_through(self.step, SCHEDULE)  # the decodes' blocks come before the rest
        base = scheduler.config
        scheduler.config = self._config_without(group.size)
        try:
            sched = scheduler.schedule()
        finally:
            scheduler.config = base
        self._first_kind = PlanKind.MIXED
        ends = [now + self._step_s(sched, group.size, group.context_sum(self.step))]
        tail = self._decode_run_after(sched)
        if tail is not None:
            num_decodes, offset_sum, num_steps = tail
            ends += self._decode_ends(ends[0], num_decodes, offset_sum, self.step + 1, num_steps)
        self._sched = sched
        self._plan(ends)

    def _decode_run_after(self, sched: SchedulerOutput) -> tuple[int, int, int] | None:
        """(decodes, their context offset sum, steps) of the decode run that follows a mixed step
        that completes every prompt it schedules, finishes no decode and leaves nothing waiting;
        None otherwise (or when the run's blocks might not fit)."""
        scheduler, group, step = self.scheduler, self.group, self.step
        running = scheduler.running
        if scheduler.waiting or len(sched.seqs) != len(running) or (group.finishes and group.next_finish_step == step):
            return None
        num_decodes, offset_sum = group.size, group.context_offset_sum
        next_finish = group.next_finish_step if group.finishes else None
        for req, seq in zip(running, sched.seqs):
            computed = seq.start_pos + seq.num_tokens
            if seq.req_id != req.req_id or not seq.sample or req.priority != 0:
                return None
            # its prompt completes (computed == its tokens): this step's token makes computed + 1
            limit = group.length_limit(req)
            if computed + 1 >= limit:
                continue  # finishes with this token: does not join
            delta = computed - (step + 1)  # as DecodeGroup.join will set it, and its finish_step:
            finish = limit - 2 - delta
            next_finish = finish if next_finish is None else min(next_finish, finish)
            num_decodes += 1
            offset_sum += delta + 1
        if not num_decodes:
            return None
        num_steps = min(next_finish - step, self.setup.max_run_steps - 1)
        if num_decodes * (num_steps // self.blocks.block_size + 1) > self.blocks.num_free_blocks:
            return None
        return num_decodes, offset_sum, num_steps

    def _start_plain(self, now: float) -> None:
        if self.group.size:
            self.scheduler.running[:0] = self.group.release_all(self.step)
        sched = self.scheduler.schedule()
        self._first_kind = PlanKind.PLAIN
        self._sched = sched
        self._plan([now + self._step_s(sched, 0, 0)])

    def _step_s(self, sched: SchedulerOutput, num_decodes: int, context_sum: int) -> float:
        """Duration of a scheduled step, with `num_decodes` decodes from the group besides `sched`."""
        chunks = []
        for seq in sched.seqs:
            if seq.num_tokens == 1:
                num_decodes += 1
                context_sum += seq.start_pos + 1
            else:
                chunks.append((seq.num_tokens, seq.start_pos + seq.num_tokens))
        return self.clock.step_s(num_decodes, context_sum, chunks)

    def _config_without(self, num_decodes: int) -> SchedulerConfig:
        config = self._configs.get(num_decodes)
        if config is None:
            base = self.setup.scheduler
            config = self._configs[num_decodes] = dataclasses.replace(
                base, max_num_batched_tokens=base.max_num_batched_tokens - num_decodes,
                max_num_seqs=base.max_num_seqs - num_decodes)
        return config

    # --- what the router scrapes -------------------------------------------------------------------
    def load_signals(self, now: float) -> LoadSignals:
        """The server's gauges as /metrics shows them at `now`: as the last step that ended left
        them (the server sets them after each step, before taking in new requests)."""
        done = bisect.bisect_right(self._ends, now) if self.busy else 0  # steps of the plan ended by now
        if done:
            if self._sched is not None:
                self._apply_first_step()
            self.group.replay_through(self.step + done - 1, UPDATE)
            num_running, num_waiting = self.group.size + len(self.scheduler.running), len(self.scheduler.waiting)
            gauges = (num_running, num_waiting, self.blocks.usage)
        else:
            gauges = self._gauges
        return LoadSignals(num_running=float(gauges[0]), num_waiting=float(gauges[1]), kv_usage=gauges[2],
                           scraped_at=now)
