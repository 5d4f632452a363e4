"""Steady-state latency of one replica: the cost model's step times turned into TTFT, TPOT and
batch size (means, and p99 estimates) at an arrival rate (Poisson or gamma) or a closed loop.

With arrival rate lam per replica, prompt length I, output length O (O - 1 decode steps after
the first token), mean decode context I + O / 2, and t_p = the time per prompt of a prefill step:

    rho   = lam * t_p                          share of time spent prefilling (must be < 1)
    TPOT  = t_decode(n) / (1 - rho)            prefill chunks steal steps from decoding
    n     = lam * (O - 1) * TPOT               Little's law: sequences decoding at once
    TTFT  = c2 rho t_p / (2 (1 - rho))         wait for the prefills ahead: M/D/1 (Pollaczek-
                                               Khinchine) for Poisson arrivals, c2 = 1; Kingman's
                                               G/D/1 for gamma arrivals of shape b, c2 = 1 / b
          + (1 - e^-n) t_decode(n) / 2         the step in flight when it arrives (if any)
          + prefill of I in chunks of (budget - n) tokens, each step shared with the n decodes

Tails (p99) come from two standard approximations, not from a distribution: the wait for the
prefills ahead is exponential beyond an atom at zero, P(W > t) = rho e^(-rho t / W) (exact in
the mean; the M/G/1 heavy-traffic form), so W_99 = (W / rho) ln(rho / 0.01); the step in flight
counts whole. A request's TPOT is t_decode plus the prompts that arrive during its decode, each
stealing t_p: a Poisson count of mean m = lam (O - 1) TPOT (variance c2 m), so TPOT_99 =
t_decode + t_p (m + 2.33 sqrt(c2 m)) / (O - 1). The decode batch's own spread is left out.

Prompts that wait together are prefilled together, as a chunked-prefill engine packs them under
its token budget B: a step takes k of them (k <= B // I), sharing one weight read and one step's
overhead, so t_p = t_step(k prompts) / k, where k = clamp(lam * t_step(k), 1, B // I) is what
arrives while one such step runs (a fixed point; k = 1 at light load, or for prompts over B).

Closed loop (`predict_closed_loop`: C clients, each sending its next request when the previous
one ends, as most published serving benchmarks run): with every request the same length, the
clients stay in step, so requests arrive in waves of C. A wave's prompts are prefilled k at a
time (k = min(C, B // I)) in m = ceil(C / k) steps of t_k; the j-th group's first token comes
after j of them (mean TTFT = t_k (m + 1) / 2), then the C sequences decode together:

    period = m t_k + (O - 1) t_decode(C)       throughput = C / period requests per second

and every request of the wave ends with it, so a request's TPOT, (E2E - TTFT) / (O - 1), also
counts the prefill steps after its first token: t_decode(C) + (m - 1) t_k / (2 (O - 1)) on average.

Offline (`predict_offline`: N requests queued at once and run to the end, as an offline
benchmark does): waves of R = what one step carries, the last of N mod R requests, which costs
its O - 1 decode steps for fewer tokens: makespan = floor(N / R) period(R) + period(N mod R),
throughput = N / makespan; a request's TTFT adds the waves before its own.

n is the smallest fixed point of the second and third lines, found by iterating from n = 0.
The replica is overloaded when rho >= 1, or n exceeds what one step can carry: the sequences
whose KV fits, and the step's token budget (each decode is one token of it; a prefill chunk
needs at least one more).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardserve.bench.stats import SLO
from shardserve.config import ConfigError
from shardserve.planner.batch_load import BatchSummary
from shardserve.planner.cost_model import Deployment, decode_step_time, prefill_time, step_time

_MAX_ITERATIONS = 200


@dataclass(frozen=True)
class Workload:
    """The traffic to serve: mean prompt and output lengths in tokens, and either a total arrival
    rate or a number of clients per replica in a closed loop (as benchmarks run). Arrivals are
    gamma-distributed with shape `burstiness` (`shardserve bench --burstiness`, vLLM's): 1 is
    Poisson, below 1 burstier."""

    input_len: int
    output_len: int
    qps: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0

    @property
    def arrival_cv2(self) -> float:
        """Squared coefficient of variation of the gaps between arrivals (gamma: 1 / shape)."""
        return 1.0 / self.burstiness

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ConfigError(f"prompt and output lengths must be at least 1, got {self.input_len}, {self.output_len}")
        if (self.qps is None) == (self.concurrency is None):
            raise ConfigError("give an arrival rate (qps) or a closed loop's concurrency, not both")
        if self.qps is not None and not 0 < self.qps < math.inf:
            raise ConfigError(f"qps must be a positive number, got {self.qps}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {self.concurrency}")
        if not 0 < self.burstiness < math.inf:
            raise ConfigError(f"burstiness must be a positive number, got {self.burstiness}")


@dataclass(frozen=True)
class ReplicaPrediction:
    """Mean behaviour of one replica at `arrival_qps`; latencies are inf when not `stable`."""

    arrival_qps: float
    stable: bool
    num_running_seqs: float
    prefill_utilization: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    decode_bottleneck: str
    ttft_p99_s: float = math.nan
    tpot_p99_s: float = math.nan

    @property
    def e2e_p99_s(self) -> float:
        """A bound more than an estimate: both tails at once."""
        return self.ttft_p99_s + (self.e2e_s - self.ttft_s) * (self.tpot_p99_s / self.tpot_s if self.tpot_s else 1.0)

    def meets(self, slo: SLO | None, tail: bool = False) -> bool:
        """Stable and within every target of `slo` (None: stability alone); `tail`: the p99s
        must meet the targets, not the means."""
        if not self.stable:
            return False
        if slo is None:
            return True
        if tail:
            checks = ((slo.ttft_ms, self.ttft_p99_s), (slo.tpot_ms, self.tpot_p99_s), (slo.e2e_ms, self.e2e_p99_s))
        else:
            checks = ((slo.ttft_ms, self.ttft_s), (slo.tpot_ms, self.tpot_s), (slo.e2e_ms, self.e2e_s))
        return all(target is None or value * 1e3 <= target for target, value in checks)


@dataclass(frozen=True)
class ReplicaModel:
    """One replica serving requests of `input_len` + `output_len` tokens, at most `max_num_seqs`
    at once (what its KV cache holds), with a per-step token budget `max_num_batched_tokens`."""

    deployment: Deployment
    input_len: int
    output_len: int
    max_num_seqs: int
    max_num_batched_tokens: int = 2048
    arrival_cv2: float = 1.0  # Workload.arrival_cv2: 1 for Poisson arrivals
    prefill_s: float = field(init=False)  # one prompt alone, in budget-sized chunks

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_s", self._prefill_s(0.0))

    def _chunk_time_s(self, chunk_len: int, context_len: int, num_decode_seqs: float) -> float:
        batch = BatchSummary(num_prefill_tokens=chunk_len, prefill_context_len=context_len,
                             num_decode_seqs=num_decode_seqs, decode_context_len=self._decode_context_len)
        return step_time(self.deployment, batch).total_s

    def _prefill_s(self, num_decode_seqs: float) -> float:
        """The prompt's steps when each also carries `num_decode_seqs` decodes: chunks of what the
        budget leaves; the full middle chunks are interpolated between the first and the one
        before the last (their cost grows linearly with the context)."""
        if num_decode_seqs == 0 and self.input_len <= self.max_num_batched_tokens:
            return prefill_time(self.deployment, self.input_len).total_s
        chunk = max(1, self.max_num_batched_tokens - math.ceil(num_decode_seqs))
        num_chunks = math.ceil(self.input_len / chunk)
        last_len = self.input_len - (num_chunks - 1) * chunk
        last = self._chunk_time_s(last_len, self.input_len, num_decode_seqs)
        if num_chunks == 1:
            return last
        first = self._chunk_time_s(chunk, chunk, num_decode_seqs)
        before_last = self._chunk_time_s(chunk, self.input_len - last_len, num_decode_seqs)
        return (num_chunks - 1) * (first + before_last) / 2 + last

    @property
    def _decode_context_len(self) -> float:
        return self.input_len + self.output_len / 2

    def packed_prefill(self, arrival_qps: float) -> tuple[int, float]:
        """(k, step seconds): how many prompts a prefill step takes at `arrival_qps`, and the
        time of that step (see the module docstring)."""
        k_max = self.max_num_batched_tokens // self.input_len
        if k_max <= 1:
            return 1, self.prefill_s
        k = 1
        for _ in range(_MAX_ITERATIONS):
            step_s = prefill_time(self.deployment, self.input_len, k).total_s
            wanted = min(k_max, max(1, math.ceil(arrival_qps * step_s)))
            if wanted == k:
                return k, step_s
            k = wanted
        return k, prefill_time(self.deployment, self.input_len, k).total_s

    def _unstable(self, arrival_qps: float, rho: float, n: float) -> ReplicaPrediction:
        return ReplicaPrediction(arrival_qps, False, n, rho, math.inf, math.inf, math.inf, "overload",
                                 math.inf, math.inf)

    def predict(self, arrival_qps: float) -> ReplicaPrediction:
        """Mean TTFT, TPOT, E2E and batch at `arrival_qps` requests/s (see the module docstring)."""
        packed, packed_step_s = self.packed_prefill(arrival_qps)
        rho = arrival_qps * packed_step_s / packed
        if rho >= 1:
            return self._unstable(arrival_qps, rho, math.inf)
        num_decode_steps = self.output_len - 1
        max_running = min(self.max_num_seqs, self.max_num_batched_tokens - 1)
        n = 0.0
        for _ in range(_MAX_ITERATIONS):
            step = decode_step_time(self.deployment, n, self._decode_context_len)
            next_n = arrival_qps * num_decode_steps * step.total_s / (1 - rho)
            if next_n > max_running:
                return self._unstable(arrival_qps, rho, next_n)
            converged = abs(next_n - n) <= 1e-4 * max(1.0, next_n)
            n = next_n
            if converged:
                break
        else:  # creeping towards the capacity edge: call it overloaded
            return self._unstable(arrival_qps, rho, n)
        step = decode_step_time(self.deployment, n, self._decode_context_len)
        tpot_s = step.total_s / (1 - rho)
        ahead_s = self.prefill_s if packed == 1 else packed_step_s  # a prefill step ahead of it
        queue_s = self.arrival_cv2 * rho * ahead_s / (2 * (1 - rho))
        own_prefill_s = self._prefill_s(n) if packed == 1 else packed_step_s
        ttft_s = queue_s + (1 - math.exp(-n)) * step.total_s / 2 + own_prefill_s
        e2e_s = ttft_s + num_decode_steps * tpot_s
        ttft_p99_s = _exponential_tail(queue_s, rho, 0.99) + (step.total_s if n > 0 else 0.0) + own_prefill_s
        prompts_meanwhile = arrival_qps * num_decode_steps * tpot_s
        stolen_s = (ahead_s / packed) * (prompts_meanwhile + 2.33 * math.sqrt(self.arrival_cv2 * prompts_meanwhile))
        tpot_p99_s = step.total_s + stolen_s / num_decode_steps if num_decode_steps else 0.0
        return ReplicaPrediction(arrival_qps, True, n, rho, ttft_s, tpot_s if num_decode_steps else 0.0, e2e_s,
                                 step.bottleneck, ttft_p99_s, tpot_p99_s)

    def _running(self, clients: int) -> int:
        """How many of `clients` requests one step carries: what the KV cache holds, and the
        step's token budget (each decode is one token of it)."""
        return min(clients, self.max_num_seqs, self.max_num_batched_tokens - 1)

    def predict_closed_loop(self, concurrency: int) -> ReplicaPrediction:
        """Mean TTFT, TPOT and E2E with `concurrency` clients in a closed loop, and the request
        rate they reach (`arrival_qps`); see the module docstring. Clients beyond what one step
        carries (KV capacity, the token budget) wait for a slot, as they would on the engine."""
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {concurrency}")
        running = self._running(concurrency)
        per_step = max(1, min(running, self.max_num_batched_tokens // self.input_len))
        num_prefill_steps = math.ceil(running / per_step)
        prefill_step_s = (prefill_time(self.deployment, self.input_len, per_step).total_s
                          if self.input_len <= self.max_num_batched_tokens else self.prefill_s)
        ttft_s = prefill_step_s * (num_prefill_steps + 1) / 2
        ttft_p99_s = prefill_step_s * num_prefill_steps  # the wave's last group
        num_decode_steps = self.output_len - 1
        step = decode_step_time(self.deployment, running, self._decode_context_len)
        period_s = num_prefill_steps * prefill_step_s + num_decode_steps * step.total_s
        # a group's tokens after its first wait out the wave's later prefill steps too: the j-th
        # of m groups decodes over (m - j) of them, (m - 1) / 2 on average, the first all but one
        tpot_s = tpot_p99_s = 0.0
        if num_decode_steps:
            tpot_s = step.total_s + (num_prefill_steps - 1) * prefill_step_s / (2 * num_decode_steps)
            tpot_p99_s = step.total_s + (num_prefill_steps - 1) * prefill_step_s / num_decode_steps
        waves_waited = math.ceil(concurrency / running) - 1  # clients without a slot sit out whole waves
        ttft_s += waves_waited * period_s
        ttft_p99_s += waves_waited * period_s
        rate = running / period_s
        return ReplicaPrediction(rate, True, running, rate * prefill_step_s * num_prefill_steps / running, ttft_s,
                                 tpot_s, ttft_s + num_decode_steps * tpot_s, step.bottleneck, ttft_p99_s, tpot_p99_s)

    def predict_offline(self, num_requests: int) -> ReplicaPrediction:
        """`num_requests` requests queued at once and served to the last one's end, as an offline
        benchmark runs (trtllm-bench throughput, vLLM's benchmark_throughput): whole waves of
        what one step carries, then a last wave of the rest, which takes as many decode steps for
        fewer tokens. `arrival_qps` is num_requests over that makespan, the throughput such a
        benchmark reports; a request's TTFT counts the waves it waited for."""
        if num_requests < 1:
            raise ConfigError(f"num_requests must be at least 1, got {num_requests}")
        running = self._running(num_requests)
        full, rest = divmod(num_requests, running)
        waves = [(running, self.predict_closed_loop(running))] * full
        if rest:
            waves.append((rest, self.predict_closed_loop(rest)))
        start_s = ttft_s = tpot_s = 0.0
        for size, wave in waves:
            ttft_s += size * (start_s + wave.ttft_s)
            tpot_s += size * wave.tpot_s
            last_start_s, start_s = start_s, start_s + size / wave.arrival_qps
        ttft_s, tpot_s = ttft_s / num_requests, tpot_s / num_requests
        first, last = waves[0][1], waves[-1][1]
        return ReplicaPrediction(num_requests / start_s, True, running, first.prefill_utilization, ttft_s, tpot_s,
                                 ttft_s + (self.output_len - 1) * tpot_s, first.decode_bottleneck,
                                 last_start_s + last.ttft_p99_s, max(wave.tpot_p99_s for _, wave in waves))

    def prefill_saturation_qps(self) -> float:
        """The arrival rate at which prefill alone fills every step (prompts packed as tightly as
        the token budget allows): no rate above it is stable."""
        k_max = max(1, self.max_num_batched_tokens // self.input_len)
        return k_max / prefill_time(self.deployment, self.input_len, k_max).total_s if k_max > 1 else 1 / self.prefill_s

    def capacity_qps(self, slo: SLO | None, rel_tol: float = 1e-3, tail: bool = False) -> float:
        """The highest arrival rate at which the replica is stable and meets `slo` (None:
        stability alone; `tail`: at p99), to `rel_tol`; 0 when not even a trickle meets it."""
        return highest_rate(lambda rate: self.predict(rate).meets(slo, tail), self.prefill_saturation_qps(), rel_tol)


def _exponential_tail(mean_wait_s: float, rho: float, q: float) -> float:
    """The q-quantile of a wait that is 0 with probability 1 - rho and exponential beyond, of
    mean `mean_wait_s` overall: P(W > t) = rho exp(-rho t / mean)."""
    if mean_wait_s <= 0 or rho <= 1 - q:
        return 0.0
    return mean_wait_s / rho * math.log(rho / (1 - q))


def highest_rate(meets, hi: float, rel_tol: float = 1e-3) -> float:
    """The highest rate below `hi` at which `meets(rate)` holds, bisecting in log space to
    `rel_tol` (meets must be monotone: true up to some rate, false above); 0 when not even
    hi * 1e-6 meets it."""
    lo = hi * 1e-6
    if not meets(lo):
        return 0.0
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo
