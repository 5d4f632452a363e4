"""Small simulated fleets and workloads for the simulator's tests."""
from __future__ import annotations

import dataclasses

import numpy as np

from shardserve.config import ParallelConfig, RouterConfig, SchedulerConfig
from shardserve.planner.cost_model import Deployment
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.sim.replica import ReplicaSetup
from shardserve.sim.simulation import ServingOverheads, SimConfig, Simulation
from shardserve.sim.workload import RequestSpec, poisson_arrivals


def deployment() -> Deployment:
    return Deployment(preset("llama-3.1-8b"), ParallelConfig(), get_hardware("H100"), "bfloat16")


def config(num_kv_blocks: int = 4096, *, max_num_batched_tokens: int = 2048, max_num_seqs: int = 128,
           prefix_caching: bool = True, max_model_len: int = 4096, replicas: int = 1, policy: str = "least_outstanding",
           router: RouterConfig | None = None, fast_path: bool = True, overheads: ServingOverheads = ServingOverheads(),
           max_waiting_requests: int = 256, records_limit: int = 50_000) -> SimConfig:
    setup = ReplicaSetup(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
                         num_kv_blocks, 16, prefix_caching, max_model_len, max_waiting_requests, fast_path=fast_path)
    if router is None and replicas > 1:
        router = RouterConfig()
    return SimConfig(deployment(), setup, replicas, policy, router, overheads, records_limit)


def shared_prefix_specs(num: int, rate_qps: float, seed: int = 0, num_prefixes: int = 4,
                        max_prompt_len: int = 600, max_output_len: int = 200) -> list[RequestSpec]:
    """Prompts that share one of a few long prefixes (prefix-cache hits), some repeated whole,
    lengths from tiny to long, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(100, 1000, size=rng.integers(16, 200)).tolist() for _ in range(num_prefixes)]
    arrivals = poisson_arrivals(num, rate_qps, seed)
    specs = []
    for i in range(num):
        prompt = list(prefixes[rng.integers(num_prefixes)]) if rng.random() < 0.7 else []
        if rng.random() < 0.85:  # else: the prefix alone, again
            prompt += rng.integers(100, 1000, size=rng.integers(1, max_prompt_len - 200)).tolist()
        prompt = prompt or [7]
        specs.append(RequestSpec(tuple(prompt), None, int(rng.integers(1, max_output_len)), arrivals[i]))
    return specs


def with_arrivals(specs: list[RequestSpec], arrivals_s: list[float]) -> list[RequestSpec]:
    return [dataclasses.replace(s, arrival_time_s=t) for s, t in zip(specs, arrivals_s)]


class ConstantClock:
    """Every step takes `step_s`, whatever the batch (for hand calculations)."""

    def __init__(self, step_s: float):
        self.step_s_value = step_s

    def decode_coefficients(self, num_decodes: int) -> tuple[float, float]:
        return self.step_s_value, 0.0

    def decode_s(self, num_decodes: int, decode_context_sum: int) -> float:
        return self.step_s_value

    def step_s(self, num_decodes: int, decode_context_sum: int, chunks) -> float:
        return self.step_s_value

    def decode_ends(self, start_s: float, num_decodes: int, decode_context_sum: int, num_steps: int) -> list[float]:
        ends = []
        for _ in range(num_steps):  # chained, as StepClock.decode_ends
            start_s += self.step_s_value
            ends.append(start_s)
        return ends


def constant_step_simulation(sim_config: SimConfig, step_s: float) -> Simulation:
    sim = Simulation(sim_config)
    for replica in sim.replicas:
        replica.clock = ConstantClock(step_s)
    return sim
