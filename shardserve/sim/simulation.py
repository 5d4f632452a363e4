"""The discrete-event simulation of a benchmark client, a router and replicas.

One heap of timed events, earliest first (ties in the order below, then first come first served):

    ARRIVE       (levels that cap concurrency) the workload wants request i sent now: sent at once,
                 or queued for a client slot (a closed loop is a cap with every arrival at 0)
    CLIENT_FREE  a request ended at the client: its slot takes the next queued request
    REACH        request i reaches the router and the server (sent + overheads.request_s): routed
                 with the real policy, submitted to the replica (or answered 429)
    WAKE         replica r's plan of steps ends (replica.py): tokens out, finished requests
                 recorded, arrivals taken in, the next plan started (stale if r has replanned)
    SCRAPE       the router reads every replica's load gauges (every probe interval)

A request reaching a replica at the very end of its step joins the next step, as the engine loop
takes in arrivals between steps. Tokens reach the client `overheads.token_s` after their step ends.
Load levels run one after another on the same fleet (their caches carry over, as on a real server
that `shardserve bench` runs several levels against); each level's times start at its own zero.
"""
from __future__ import annotations

import gc
import heapq
import itertools
import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from shardserve.bench.stats import SLO, BenchResult, LoadLevel
from shardserve.config import ConfigError, RouterConfig
from shardserve.planner.cost_model import Deployment
from shardserve.request import SamplingParams
from shardserve.router.admission import RouterError
from shardserve.router.policies import PrefixAware
from shardserve.sim.replica import ReplicaSetup, SimReplica
from shardserve.sim.sim_request import SimRequest
from shardserve.sim.sim_results import LevelResults
from shardserve.sim.sim_router import SimRouter
from shardserve.sim.step_clock import StepClock
from shardserve.sim.workload import RequestSpec

ARRIVE, CLIENT_FREE, REACH, WAKE, SCRAPE = range(5)


@dataclass(frozen=True)
class ServingOverheads:
    """What serving adds to the engine's own steps (docs/planning.md, "Simulator"; each measurable
    against a real server, as benchmarks/sim_accuracy.py does):
    request_s           from the client sending a request to the engine loop holding it (HTTP,
                        JSON, validation, the hand-over to the engine thread)
    token_s             from the end of the step that sampled a token to the client reading its
                        chunk (the output queue, SSE framing, the socket)
    decode_step_scale   a serving replica's decode-only step time over the profiled engine's: 1
                        where HTTP runs beside an accelerator; above 1 on a CPU host, where the
                        server's HTTP thread and a local client take cycles from the model
    prompt_step_scale   the same for steps that prefill (large matrix products suffer less)
    step_seq_s          time added to a step per sequence in it: on a CPU host each token a step
                        emits is streamed (SSE framing, the socket, the client reading it) by
                        threads that share the cores and the GIL with the engine, so a step's
                        serving cost grows with its batch; 0 beside an accelerator"""

    request_s: float = 0.0
    token_s: float = 0.0
    decode_step_scale: float = 1.0
    prompt_step_scale: float = 1.0
    step_seq_s: float = 0.0

    def __post_init__(self) -> None:
        if (min(self.request_s, self.token_s, self.step_seq_s) < 0
                or min(self.decode_step_scale, self.prompt_step_scale) <= 0):
            raise ConfigError("serving delays must be >= 0 and step scales > 0")


@dataclass(frozen=True)
class SimConfig:
    """A simulated fleet: `num_replicas` replicas of `deployment` (the cost model's view) set up as
    `setup` says, behind a router with `policy` and `router` settings; `router=None` has clients
    talk to a single replica directly, like `shardserve bench` against one server."""

    deployment: Deployment
    setup: ReplicaSetup
    num_replicas: int = 1
    policy: str = "least_outstanding"
    router: RouterConfig | None = field(default_factory=RouterConfig)
    overheads: ServingOverheads = ServingOverheads()
    records_limit: int = 50_000  # up to this many requests a level summarizes via RequestRecords

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"need at least one replica, got {self.num_replicas}")
        if self.router is None and self.num_replicas != 1:
            raise ConfigError("without a router the client talks to one replica; give a router for more")


class Simulation:
    """A fleet that runs load levels one after another (`run_level`)."""

    def __init__(self, config: SimConfig):
        self.config = config
        # one clock for the fleet: its cached forms are built once
        overheads = config.overheads
        clock = StepClock(config.deployment, config.setup.max_model_len, overheads.decode_step_scale,
                          overheads.prompt_step_scale, overheads.step_seq_s)
        self.replicas = [SimReplica(i, config.setup, clock) for i in range(config.num_replicas)]
        self.router = SimRouter(config.num_replicas, config.policy, config.router) if config.router else None
        for replica in self.replicas:
            replica.keep_gauges = self.scrapes
        self.now = 0.0
        self._params: dict[int, SamplingParams] = {}

    def run_level(self, level: LoadLevel, specs: Iterable[RequestSpec], slo: SLO | None = None) -> BenchResult:
        """Send `specs` (arrival times relative to the level's start; a cap of `level.concurrency`
        in flight) and summarize like `shardserve bench`."""
        run = _LevelRun(self, level, specs)
        # The loop makes no reference cycles, and Python's cycle collector would rescan the
        # fleet's live requests and blocks again and again (a fifth of the run time): off meanwhile.
        collecting = gc.isenabled()
        gc.disable()
        try:
            run.loop()
        finally:
            if collecting:
                gc.enable()
        self.now = run.last_event_s
        return run.results.summarize([r.step_end_s for r in self.replicas], slo, self.config.records_limit)

    @property
    def scrapes(self) -> bool:
        """Whether the router reads the replicas' load (every policy but round robin uses it)."""
        return self.router is not None and self.config.policy != "round_robin"

    def params_for(self, output_len: int) -> SamplingParams:
        params = self._params.get(output_len)
        if params is None:
            params = self._params[output_len] = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        return params


def simulate(config: SimConfig, plans: list[tuple[LoadLevel, Iterable[RequestSpec]]],
             slo: SLO | None = None) -> list[BenchResult]:
    """Run each (load level, requests) in turn on one simulated fleet; one BenchResult per level."""
    sim = Simulation(config)
    return [sim.run_level(level, specs, slo) for level, specs in plans]


def _in_arrival_order(specs: Iterable[RequestSpec]) -> Iterator[tuple[int, RequestSpec]]:
    """(index, spec) by arrival time. A list is sorted (ties by index); a stream must come sorted."""
    if isinstance(specs, (list, tuple)):
        yield from sorted(enumerate(specs), key=lambda p: (p[1].arrival_time_s, p[0]))
        return
    last_s = 0.0
    for index, spec in enumerate(specs):
        if spec.arrival_time_s < last_s:
            raise ConfigError("simulate: a streamed workload must come in arrival order")
        last_s = spec.arrival_time_s
        yield index, spec


class _LevelRun:
    """The event loop of one load level (module docstring)."""

    def __init__(self, sim: Simulation, level: LoadLevel, specs: Iterable[RequestSpec]):
        self.sim, self.level = sim, level
        self.config = sim.config
        self.start_s = self.last_event_s = sim.now
        self.results = LevelResults(level, self.start_s, self.config.overheads.token_s)
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.counter = itertools.count()
        self.arrivals = _in_arrival_order(specs)
        self.arrivals_done = False
        self.cap = level.concurrency
        self.queue: deque[tuple[int, RequestSpec, float]] = deque()
        self.num_in_flight = 0  # sent, not yet ended at the client
        self.needs_prefix = sim.router is not None and isinstance(sim.router.policy, PrefixAware)

    def push(self, time_s: float, kind: int, a: int, b: object = None) -> None:
        heapq.heappush(self.heap, (time_s, kind, next(self.counter), a, b))

    def loop(self) -> None:
        self._next_arrival()
        if self.sim.scrapes:
            self.push(self.start_s, SCRAPE, 0)
        handlers = {ARRIVE: self._arrive, CLIENT_FREE: self._client_free, REACH: self._reach, WAKE: self._wake,
                    SCRAPE: self._scrape}
        heap, pop, wake = self.heap, heapq.heappop, self._wake
        time_s = self.start_s
        while heap:
            time_s, kind, _, a, b = pop(heap)
            if kind == WAKE:
                wake(time_s, a, b)
            else:
                handlers[kind](time_s, a, b)
        self.last_event_s = time_s

    # --- the client -------------------------------------------------------------------------------
    def _next_arrival(self) -> None:
        """Queue the workload's next request (one at a time: a workload may be a stream)."""
        for index, spec in self.arrivals:
            arrival_s = self.start_s + spec.arrival_time_s
            if self.cap is None:  # nothing to wait for: sent on arrival, straight to REACH
                self.num_in_flight += 1
                self.push(arrival_s + self.config.overheads.request_s, REACH, index, (spec, arrival_s, arrival_s))
            else:
                self.push(arrival_s, ARRIVE, index, spec)
            return
        self.arrivals_done = True

    def _arrive(self, now: float, index: int, spec: RequestSpec) -> None:
        self._next_arrival()
        if self.cap is not None and self.num_in_flight >= self.cap:
            self.queue.append((index, spec, now))
            return
        self._send(index, spec, now, now)

    def _send(self, index: int, spec: RequestSpec, scheduled_s: float, now: float) -> None:
        self.num_in_flight += 1
        self.push(now + self.config.overheads.request_s, REACH, index, (spec, scheduled_s, now))

    def _ended(self, client_end_s: float) -> None:
        if self.cap is not None:
            self.push(client_end_s, CLIENT_FREE, 0)
        else:
            self.num_in_flight -= 1

    def _client_free(self, now: float, _a, _b) -> None:
        self.num_in_flight -= 1
        if self.queue:
            index, spec, scheduled_s = self.queue.popleft()
            self._send(index, spec, scheduled_s, now)

    # --- the router and the servers -------------------------------------------------------------
    def _reach(self, now: float, index: int, payload) -> None:
        if self.cap is None:
            self._next_arrival()
        spec, scheduled_s, sent_s = payload
        if spec.prompt_token_ids is None:
            raise ConfigError("simulate needs prompts as token ids (a trace's text prompts cannot be counted)")
        max_model_len = self.config.setup.max_model_len
        if len(spec.prompt_token_ids) >= max_model_len:
            message = (f"prompt has {len(spec.prompt_token_ids)} tokens but the context window is {max_model_len} "
                       "(prompt plus at least one generated token must fit)")
            return self._fail(now, index, spec, scheduled_s, sent_s, 400, message)
        req = SimRequest(req_id=f"{index}", prompt_token_ids=list(spec.prompt_token_ids),
                         params=self.sim.params_for(spec.output_len), seed=0, index=index, start_s=sent_s,
                         scheduled_s=scheduled_s)
        router, replicas = self.sim.router, self.sim.replicas
        if router is None:
            if not self._submit(0, req, now):
                message = f"{replicas[0].num_unscheduled()} requests are already waiting"
                self._fail(now, index, spec, scheduled_s, sent_s, 429, message)
            return
        prefix = json.dumps(list(spec.prompt_token_ids))[: self.config.router.prefix_chars] if self.needs_prefix else ""
        try:
            router.route(prefix, lambda i: self._submit(i, req, now))
        except RouterError as exc:
            self._fail(now, index, spec, scheduled_s, sent_s, exc.status, exc.message)

    def _submit(self, i: int, req: SimRequest, now: float) -> bool:
        replica = self.sim.replicas[i]
        version = replica.version
        accepted = replica.submit(req, now)
        if accepted and replica.version != version:
            self.push(replica.wake_s, WAKE, i, replica.version)
        return accepted

    def _fail(self, now: float, index: int, spec: RequestSpec, scheduled_s: float, sent_s: float,
              status: int, message: str) -> None:
        end_s = now + self.config.overheads.token_s
        self.results.add_failed(index, spec.prompt_len, spec.output_len, scheduled_s, sent_s, end_s, status,
                                f"HTTP {status}: {message}")
        self._ended(end_s)

    def _wake(self, now: float, i: int, version: int) -> None:
        replica = self.sim.replicas[i]
        if version != replica.version:
            return
        replica.wake(now)
        if replica.finished:
            router, token_s = self.sim.router, self.config.overheads.token_s
            for req in replica.finished:
                self.results.add_finished(req, i)
                if router is not None:
                    router.request_ended(i)
                self._ended(now + token_s)
            replica.finished = []
        if replica.busy:
            self.push(replica.wake_s, WAKE, i, replica.version)

    def _scrape(self, now: float, _a, _b) -> None:
        self.sim.router.scraped([r.load_signals(now) for r in self.sim.replicas])
        if not (self.arrivals_done and self.num_in_flight == 0 and not self.queue):
            self.push(now + self.config.router.probe_interval_s, SCRAPE, 0)
