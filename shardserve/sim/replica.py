"""A simulated replica: the engine's own Scheduler and BlockManager, the cost model as its clock.

The real engine loop is: take in the requests that arrived, schedule, run the model, update, emit
the sampled tokens at the end of the step, repeat while there is work. Here "run the model" is the
StepClock's duration and one fake sampled token per sampling sequence (workloads ignore EOS, so a
request's length is its max_tokens, exactly). Steps are numbered; every request remembers the steps
at which it emitted (sim_request.py) and `step_end_s` holds when each step ended.

What a step is, by what the batch holds (D = the DecodeGroup, decode_group.py):

    decode run   only decodes, nothing to admit: up to the next finish, k steps at once (their
                 durations from the clock in one call); an arrival cuts the run after the step in
                 flight; D replays its block events lazily
    mixed        D's decodes plus prefill chunks or admissions: the real Scheduler.schedule() sees
                 only the rest of `running`, with its token and sequence budgets less |D|
    plain        the real schedule() on everything, D handed back first: whenever a block could
                 run out (preemption) or a preempted request is waiting to come back

All three leave the Scheduler and BlockManager exactly as stepping one by one would
(tests/sim/test_fast_path.py compares them on every step).
"""
from __future__ import annotations

import bisect
import dataclasses
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
        self.step = 0  # number of the next step
        self.step_end_s = array("d")  # end time of every finished step
        self.pending: list[SimRequest] = []  # arrived during the step in flight
        self.finished: list[SimRequest] = []  # since the caller last collected them
        self.busy = False
        self.wake_s = 0.0  # end of the work in flight
        self.version = 0  # bumped when wake_s moves (stale wake-ups are ignored)
        self._sched: SchedulerOutput | None = None  # the single step in flight (mixed or plain)
        self._run_end_s: list[float] | None = None  # the decode run in flight: its steps' end times
        self._configs: dict[int, SchedulerConfig] = {}
        self.num_steps_by_kind = {"run": 0, "mixed": 0, "plain": 0}  # steps taken each way
        self._gauges: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, KV usage after the last step

    # --- requests in ------------------------------------------------------------------------------
    def num_unscheduled(self) -> int:
        return len(self.scheduler.waiting) + len(self.pending)

    def submit(self, req: SimRequest, now: float) -> bool:
        """A request reaches the server at `now`. False (HTTP 429) when too many are unscheduled,
        like AsyncEngine.submit. Otherwise it joins the Scheduler after the step in flight (a decode
        run is cut after the step in flight), or at once when idle."""
        if self.num_unscheduled() + 1 > self.setup.max_waiting_requests:
            return False
        if not self.busy:
            self.scheduler.add_request(req)
            self._start(now)
            return True
        self.pending.append(req)
        run = self._run_end_s
        if run is not None:
            in_flight = bisect.bisect_left(run, now)  # the first step ending at or after now
            if in_flight < len(run) - 1:
                del run[in_flight + 1:]
                self.wake_s = run[in_flight]
                self.version += 1
        return True

    # --- the work in flight ends ---------------------------------------------------------------------
    def wake(self, now: float) -> None:
        """The step or run in flight ended at `now`: apply it, take in arrivals, start the next."""
        if self._run_end_s is not None:
            self.step_end_s.extend(self._run_end_s)
            self.step += len(self._run_end_s)
            self.num_steps_by_kind["run"] += len(self._run_end_s)
            self._run_end_s = None
            self.group.replay_through(self.step - 1, UPDATE)
        else:
            sched, self._sched = self._sched, None
            self.group.replay_through(self.step, UPDATE)  # the decodes' update comes before the rest
            result = ModelRunnerOutput({s.req_id: SampledToken(FAKE_TOKEN_ID) for s in sched.seqs if s.sample})
            for req in self.scheduler.update(sched, result):
                req.emitted_at(self.step)
                if req.is_finished:
                    self.finished.append(req)
            self.step_end_s.append(now)
            self.step += 1
        if self.group.finished:
            self.finished += self.group.finished
            self.group.finished = []
        self._join_decodes()
        self._gauges = (self.group.size + len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage)
        for req in self.pending:
            self.scheduler.add_request(req)
        self.pending = []
        self._start(now)

    def _join_decodes(self) -> None:
        """Move the decoding requests at the front of `running` into the decode group."""
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
                group.join(req, self.step)

    # --- the next step -----------------------------------------------------------------------------
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
                return self._start_run(now, num_steps)
        elif self._mixed_is_exact():
            return self._start_mixed(now)
        self._start_plain(now)

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

    def _start_run(self, now: float, num_steps: int) -> None:
        """Plan `num_steps` decode steps; every context grows by one a step. The same float
        operations as single steps (clock.decode_s, then now + duration), one step at a time."""
        num_decodes, context_sum = self.group.size, self.group.context_sum(self.step)
        coefficients = self.clock.decode_coefficients(num_decodes)
        ends, end_s = [], now
        for _ in range(num_steps):
            if coefficients is None:
                end_s += self.clock.decode_s(num_decodes, context_sum)
            else:
                end_s += coefficients[0] + coefficients[1] * context_sum
            ends.append(end_s)
            context_sum += num_decodes
        self._run_end_s = ends
        self.wake_s = end_s
        self.version += 1

    def _start_mixed(self, now: float) -> None:
        group, scheduler = self.group, self.scheduler
        group.replay_through(self.step, SCHEDULE)  # the decodes' blocks come before the rest
        base = scheduler.config
        scheduler.config = self._config_without(group.size)
        try:
            sched = scheduler.schedule()
        finally:
            scheduler.config = base
        self.num_steps_by_kind["mixed"] += 1
        self._begin_step(now, sched, group.size, group.context_sum(self.step))

    def _start_plain(self, now: float) -> None:
        if self.group.size:
            self.scheduler.running[:0] = self.group.release_all(self.step)
        self.num_steps_by_kind["plain"] += 1
        self._begin_step(now, self.scheduler.schedule(), 0, 0)

    def _begin_step(self, now: float, sched: SchedulerOutput, num_decodes: int, context_sum: int) -> None:
        chunks = []
        for seq in sched.seqs:
            if seq.num_tokens == 1:
                num_decodes += 1
                context_sum += seq.start_pos + 1
            else:
                chunks.append((seq.num_tokens, seq.start_pos + seq.num_tokens))
        self._sched = sched
        self.wake_s = now + self.clock.step_s(num_decodes, context_sum, chunks)
        self.version += 1

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
        run = self._run_end_s
        done = bisect.bisect_right(run, now) if run is not None else 0  # steps of the run ended by now
        if done:
            self.group.replay_through(self.step + done - 1, UPDATE)
            num_running, num_waiting = self.group.size + len(self.scheduler.running), len(self.scheduler.waiting)
            gauges = (num_running, num_waiting, self.blocks.usage)
        else:
            gauges = self._gauges
        return LoadSignals(num_running=float(gauges[0]), num_waiting=float(gauges[1]), kv_usage=gauges[2],
                           scraped_at=now)
