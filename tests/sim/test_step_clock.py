"""The simulator's clock is the cost model: its cached forms give the cost model's step times."""
from __future__ import annotations

import math
import random

import pytest

from shardserve.config import ParallelConfig
from shardserve.planner.cost_model import Deployment, step_time
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.sim.step_clock import StepClock

MAX_MODEL_LEN = 4096


def deployments() -> list[Deployment]:
    h100 = get_hardware("H100")
    return [Deployment(preset("llama-3.1-8b"), ParallelConfig(), h100, "bfloat16"),
            Deployment(preset("llama-3.1-70b"), ParallelConfig(tp_size=4, pp_size=2), h100, "bfloat16"),
            Deployment(preset("mixtral-8x7b"), ParallelConfig(tp_size=2, ep_size=2), h100, "bfloat16")]


def random_batch(rng: random.Random, num_decodes: int, chunks: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    decodes = [(1, rng.randrange(2, MAX_MODEL_LEN)) for _ in range(num_decodes)]
    prompt_chunks = []
    for _ in range(chunks):
        num_tokens = rng.randrange(2, 600)
        prompt_chunks.append((num_tokens, num_tokens + rng.choice([0, 0, rng.randrange(0, 2000)])))
    return decodes, prompt_chunks


@pytest.mark.parametrize("dep", deployments(), ids=["8b", "70b-tp4-pp2", "mixtral-tp2-ep2"])
def test_clock_gives_the_cost_models_step_times(dep):
    clock, rng = StepClock(dep, MAX_MODEL_LEN), random.Random(0)
    for trial in range(400):
        num_decodes = rng.choice([0, 1, 2, 7, 30, 128])
        decodes, chunks = random_batch(rng, num_decodes, rng.choice([0, 1, 1, 2]) if num_decodes else rng.choice([1, 2]))
        if trial % 3 == 0 and chunks:  # shapes repeat, so the mixed form gets fitted and used
            chunks = [(300, 300)][:len(chunks)] + chunks[1:]
        expected = step_time(dep, chunks + decodes).total_s
        got = clock.step_s(num_decodes, sum(c for _, c in decodes), chunks)
        assert math.isclose(got, expected, rel_tol=1e-9), (num_decodes, chunks)


@pytest.mark.parametrize("num_decodes", [17, 1])
def test_decode_run_lands_on_single_steps_exactly(num_decodes):
    """A replica plans a run of decode steps at once (clock.decode_ends): each end must be where
    chaining single steps puts it, bit for bit, and each step the cost model's own time."""
    dep = deployments()[0]
    clock = StepClock(dep, MAX_MODEL_LEN)
    ends = clock.decode_ends(1.5, num_decodes, num_decodes * 300, 50)
    end_s, context = 1.5, 300
    for got in ends:
        step_s = clock.decode_s(num_decodes, num_decodes * context)
        assert math.isclose(step_s, step_time(dep, [(1, context)] * num_decodes).total_s, rel_tol=1e-9)
        end_s += step_s
        assert got == end_s
        context += 1


def test_mixed_form_is_fitted_once_a_shape_repeats():
    dep = deployments()[0]
    clock = StepClock(dep, MAX_MODEL_LEN)
    clock.mixed_s(12, 12 * 500, (256, 256))
    assert clock._mixed[(12, 256, 256)] == 1  # seen once: asked directly
    clock.mixed_s(12, 12 * 900, (256, 256))
    assert isinstance(clock._mixed[(12, 256, 256)], tuple)  # two lines, checked against the model


def test_serving_scales_stretch_decode_and_prompt_steps_apart():
    dep = deployments()[0]
    plain, served = StepClock(dep, MAX_MODEL_LEN), StepClock(dep, MAX_MODEL_LEN, 1.2, 1.05)
    assert math.isclose(served.step_s(8, 8 * 300, []), 1.2 * plain.step_s(8, 8 * 300, []), rel_tol=1e-9)
    for _ in range(2):  # direct, then the fitted form
        assert math.isclose(served.step_s(8, 8 * 300, [(128, 128)]), 1.05 * plain.step_s(8, 8 * 300, [(128, 128)]),
                            rel_tol=1e-9)
    assert math.isclose(served.step_s(0, 0, [(64, 64), (32, 32)]), 1.05 * plain.step_s(0, 0, [(64, 64), (32, 32)]),
                        rel_tol=1e-9)


def test_serving_cost_per_sequence_is_added_to_every_step_shape():
    dep = deployments()[0]
    plain, served = StepClock(dep, MAX_MODEL_LEN), StepClock(dep, MAX_MODEL_LEN, 1.0, 1.0, 0.0002)
    for _ in range(2):  # direct, then the cached exact forms
        assert math.isclose(served.step_s(8, 8 * 300, []), plain.step_s(8, 8 * 300, []) + 8 * 0.0002, rel_tol=1e-9)
        assert math.isclose(served.step_s(8, 8 * 300, [(128, 128)]),
                            plain.step_s(8, 8 * 300, [(128, 128)]) + 9 * 0.0002, rel_tol=1e-9)
    assert math.isclose(served.step_s(3, 3 * 50, [(64, 64), (32, 32)]),
                        plain.step_s(3, 3 * 50, [(64, 64), (32, 32)]) + 5 * 0.0002, rel_tol=1e-9)
