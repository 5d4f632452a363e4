"""The thread governor keeps the count whose steps measure fastest, and the count never changes a
result. Step times come from a fake host, so the rule is tested without timing anything."""
import random

import pytest
import torch

from shardserve import SamplingParams
from shardserve.engine.thread_governor import ThreadGovernor, ThreadPolicy, candidate_counts
from shardserve.llm import LLM

POLICY = ThreadPolicy(max_threads=2, probe_every=20, max_probe_every=160, first_probe_after=4, probe_steps=3,
                      min_gain=0.1)


class FakeHost:
    """Seconds per token of a step at each thread count; `run` drives a governor for n steps."""

    def __init__(self, governor: ThreadGovernor, per_token_s: dict[int, float]):
        self.governor = governor
        self.per_token_s = per_token_s
        self.threads_seen: list[int] = []

    def run(self, steps: int, tokens: int = 32) -> None:
        for _ in range(steps):
            threads = self.governor.before_step()
            self.threads_seen.append(threads)
            self.governor.after_step(tokens, tokens * self.per_token_s[threads])


def governor(policy: ThreadPolicy = POLICY) -> tuple[ThreadGovernor, list[int]]:
    applied: list[int] = []
    return ThreadGovernor(policy, applied.append), applied


def test_candidates_are_all_half_and_one():
    assert candidate_counts(2) == (2, 1)
    assert candidate_counts(16) == (16, 8, 1)
    assert candidate_counts(1) == (1,)


def test_a_contended_host_moves_to_one_thread_and_back_when_it_quiets():
    gov, applied = governor()
    host = FakeHost(gov, {2: 0.020, 1: 0.011})  # another process on one core: 1 thread is faster
    host.run(4 + 6)  # 4 steps, then a probe: 2, 1, 2, 1, 2, 1
    assert host.threads_seen == [2, 2, 2, 2, 2, 1, 2, 1, 2, 1]
    assert gov.current == 1 and gov.num_switches == 1
    host.run(19)
    assert host.threads_seen[-19:] == [1] * 19  # no probe until probe_every steps have passed
    host.per_token_s = {2: 0.006, 1: 0.009}  # the neighbour left
    host.run(1 + 6)
    assert gov.current == 2 and gov.num_switches == 2
    assert applied == [2, 1, 2, 1, 2, 1] * 2  # set only when the count changes


def probe_starts(threads_seen: list[int]) -> list[int]:
    """The steps where a probe began (its first 1-thread step is its second), while 2 threads
    are the count."""
    return [i - 1 for i, n in enumerate(threads_seen) if n == 1 and (i < 2 or threads_seen[i - 2] != 1)]


def test_a_gain_under_min_gain_does_not_switch_and_probes_back_off():
    gov, _ = governor()
    host = FakeHost(gov, {2: 0.010, 1: 0.0095})
    host.run(700)
    assert gov.current == 2 and gov.num_switches == 0
    # each probe that keeps the count doubles the wait after it: 40, 80, 160, then 160 (the cap)
    assert probe_starts(host.threads_seen) == [4, 4 + 6 + 40, 50 + 6 + 80, 136 + 6 + 160, 302 + 6 + 160,
                                               468 + 6 + 160]


def test_steps_grown_costlier_bring_the_next_probe_forward():
    gov, _ = governor()
    host = FakeHost(gov, {2: 0.006, 1: 0.009})
    host.run(142 + 30)  # probes at 4, 50 and 136 kept 2 threads: the next is due at 142 + 160
    assert gov.current == 2 and probe_starts(host.threads_seen) == [4, 50, 136]
    host.per_token_s = {2: 0.020, 1: 0.011}  # a neighbour arrives, 30 steps after the last probe ...
    host.run(3 + 6 + 2)  # ... three costlier steps of the last five say so: a probe at once, not at 302
    assert host.threads_seen[172:] == [2, 2, 2] + [2, 1] * 3 + [1, 1]
    assert gov.current == 1 and gov.num_switches == 1


def test_a_rise_waits_probe_every_steps_after_the_last_probe():
    gov, _ = governor()
    host = FakeHost(gov, {2: 0.006, 1: 0.009})
    host.run(142 + 2)
    host.per_token_s = {2: 0.020, 1: 0.011}  # 2 steps after a probe: the next one waits until 20
    host.run(18 + 6)
    assert host.threads_seen[144:] == [2] * 18 + [2, 1] * 3 and gov.current == 1


def test_steps_are_compared_per_token_with_a_fixed_overhead():
    """A probe's steps differ in size; the cost is time / (tokens + overhead_tokens)."""
    gov, _ = governor(ThreadPolicy(max_threads=2, probe_every=50, first_probe_after=0, probe_steps=1,
                                   overhead_tokens=16))
    gov.before_step()  # the probe's step at 2 threads: 64 tokens in 0.8 s -> 0.01 s per token
    gov.after_step(64, 0.8)
    gov.before_step()  # at 1 thread: 4 tokens in 0.3 s -> 0.015 s per token: slower, despite 0.3 < 0.8
    gov.after_step(4, 0.3)
    assert gov.current == 2 and gov.num_probes == 1


def test_an_idle_probe_decides_nothing():
    gov, _ = governor()
    for _ in range(4 + 6):
        gov.before_step()
        gov.after_step(0, 0.001)
    assert gov.current == 2 and gov.num_probes == 1 and gov.num_switches == 0


def test_a_fixed_count_is_set_once_and_never_probed():
    gov, applied = governor(ThreadPolicy(max_threads=3, adaptive=False))
    host = FakeHost(gov, {3: 1.0})
    host.run(500)
    assert applied == [3] and set(host.threads_seen) == {3} and gov.num_probes == 0


def test_the_engine_steps_with_its_governor_and_the_count_does_not_change_logprobs():
    """Every kernel splits over independent rows, heads or columns: 1 and 2 threads agree bitwise."""
    llm = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512, show_progress=False,
              enable_prefix_caching=False,
              cpu_threads=1)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 150))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    try:
        outputs = {}
        for threads in (1, 2):
            applied: list[int] = []
            llm.engine.threads = ThreadGovernor(ThreadPolicy(threads, adaptive=False), applied.append)
            torch.set_num_threads(threads)
            outputs[threads] = [[(lp.token_id, lp.logprob, lp.top) for lp in out.outputs[0].logprobs]
                                for out in llm.generate(prompts, params)]
            assert applied == [threads]
        assert outputs[1] == outputs[2]
    finally:
        torch.set_num_threads(POLICY.max_threads)
