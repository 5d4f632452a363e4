"""Fits the cost model's efficiency factors and host overhead terms to measured step times.

The model is the planner's own `cost_model.step_time` (so the planner and the simulator predict
with exactly the fitted function); the free parameters are the inverse efficiencies of GEMM,
prefill and decode attention, memory (and network, when the profile has communication), the
compute/memory `overlap`, and the three host overhead terms of `Efficiency.overhead_s` (per
step, per sequence, per new token). Per step i:

    predicted_i = step_time(deployment with those parameters, batch_i).total_s
    minimize    sum_i rho((predicted_i / measured_i - 1)^2)     (relative error; rho = soft L1)
              + w^2 sum_i ((overhead_i - host_i) / measured_i)^2

The second sum ties the model's host overhead (`StepTime.overhead_s`: what the roofline leaves
out) to what the profiler measured outside the GEMMs and attention (elementwise, sampling and
host time) with a small weight w: the totals alone cannot tell a per-step constant from a
slightly lower efficiency, and a quick sweep has few steps per parameter. A third, tinier
term (weight 0.01 on the log of each inverse factor's distance from its prior) keeps a factor
the steps say nothing about (attention on a model too small for attention to matter) at the
prior instead of wherever the optimizer left it.

Relative residuals weigh a 20 ms decode step like a 2 s prefill, which is what TPOT and TTFT
predictions need; soft L1 keeps one step slowed down by a neighbour on a shared host from
pulling the fit. The roofline's max() makes the objective piecewise smooth, so the fit starts
from several points (the priors among them) and keeps the best. Inverse efficiencies are
bounded to [1, 1000] (factors in (0, 1]), overlap to [0, 1], overheads to [0, 10 s].
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from shardserve.planner.cost_model import Deployment, step_time
from shardserve.planner.efficiency import Efficiency

_FACTORS = ("gemm", "attention", "decode_attention", "memory", "network")
_OVERHEADS = ("step_overhead_s", "seq_overhead_s", "token_overhead_s")


@dataclass(frozen=True)
class FitSample:
    """One measured step: its batch ((new tokens, context length) per sequence) and wall time."""

    kind: str
    batch: tuple[tuple[int, int], ...]
    measured_s: float
    host_s: float | None = None  # measured time outside GEMMs, attention and communication


@dataclass(frozen=True)
class FitResult:
    efficiency: Efficiency  # calibrated=True, step_time_mape set
    predicted_s: tuple[float, ...]  # per sample, by the fitted model
    mape: float
    mape_by_kind: dict[str, float]
    fitted: tuple[str, ...]  # the parameters the fit was free to move

    @property
    def num_samples(self) -> int:
        return len(self.predicted_s)


def _efficiency(names: tuple[str, ...], x: np.ndarray, base: Efficiency) -> Efficiency:
    values = {}
    for name, value in zip(names, x):
        if name in _FACTORS:
            values[name] = float(min(1.0, 1.0 / value))
        elif name == "overlap":
            values[name] = float(min(1.0, max(0.0, value)))
        else:
            values[name] = float(max(0.0, value))
    return dataclasses.replace(base, **values)


_HOST_WEIGHT = 0.3
_PRIOR_WEIGHT = 0.01


def _predict(dep: Deployment, eff: Efficiency, samples: list[FitSample]) -> tuple[np.ndarray, np.ndarray]:
    """(total, overhead) seconds per sample."""
    fitted = dataclasses.replace(dep, efficiency=eff)
    times = [step_time(fitted, s.batch) for s in samples]
    return np.array([t.total_s for t in times]), np.array([t.overhead_s for t in times])


def _starts(names: tuple[str, ...], prior: Efficiency, samples: list[FitSample]) -> list[np.ndarray]:
    """Starting points: the priors, ideal hardware, and two pessimistic corners; overheads from
    a share of the fastest step."""
    fastest_s = min(s.measured_s for s in samples)
    prior_inverse = {name: 1.0 / (prior.decode_attention_factor if name == "decode_attention" else getattr(prior, name))
                     for name in _FACTORS}
    corners = [{**prior_inverse, "overlap": prior.overlap},
               {**dict.fromkeys(_FACTORS, 1.0), "overlap": 0.0},
               {"gemm": 2.0, "attention": 8.0, "decode_attention": 8.0, "memory": 1.5, "network": 2.0, "overlap": 0.5},
               {"gemm": 1.2, "attention": 3.0, "decode_attention": 20.0, "memory": 3.0, "network": 4.0,
                "overlap": 0.2}]
    overheads = [{"step_overhead_s": 0.1 * fastest_s, "seq_overhead_s": 0.0, "token_overhead_s": 0.0},
                  {"step_overhead_s": 0.3 * fastest_s, "seq_overhead_s": 0.01 * fastest_s,
                   "token_overhead_s": 0.001 * fastest_s}]
    starts = []
    for i, corner in enumerate(corners):
        values = {**corner, **overheads[i % len(overheads)]}
        starts.append(np.array([values[name] for name in names]))
    return starts


def fit_efficiency(dep: Deployment, samples: list[FitSample], source: str,
                   fit_network: bool | None = None) -> FitResult:
    """Fit `dep`'s efficiency (its current one is the prior) to `samples`. The network factor is
    fitted only when `fit_network` (default: the layout has more than one rank)."""
    if len(samples) < 2:
        raise ValueError("a calibration fit needs at least two measured steps")
    # the fitted per-token host term carries the elementwise work, as the cost model's
    # activation traffic would: counting both would count it twice
    prior = dataclasses.replace(dep.efficiency, activation_traffic=0.0)
    fit_network = dep.parallel.world_size > 1 if fit_network is None else fit_network
    names = tuple(n for n in _FACTORS if n != "network" or fit_network) + ("overlap",) + _OVERHEADS
    measured = np.array([s.measured_s for s in samples])
    lower = np.array([1.0 if n in _FACTORS else 0.0 for n in names])
    upper = np.array([1000.0 if n in _FACTORS else 1.0 if n == "overlap" else 10.0 for n in names])

    with_host = [i for i, s in enumerate(samples) if s.host_s is not None]
    host = np.array([samples[i].host_s for i in with_host])

    factor_index = [i for i, n in enumerate(names) if n in _FACTORS]
    prior_log = np.log(_starts(names, prior, samples)[0][factor_index])

    def residuals(x: np.ndarray) -> np.ndarray:
        total, overhead = _predict(dep, _efficiency(names, x, prior), samples)
        host_error = _HOST_WEIGHT * (overhead[with_host] - host) / measured[with_host]
        prior_pull = _PRIOR_WEIGHT * (np.log(x[factor_index]) - prior_log)
        return np.concatenate([total / measured - 1.0, host_error, prior_pull])

    best = None
    for x0 in _starts(names, prior, samples):
        result = least_squares(residuals, np.clip(x0, lower, upper), bounds=(lower, upper), loss="soft_l1",
                               f_scale=0.05, x_scale="jac", max_nfev=400)
        if best is None or result.cost < best.cost:
            best = result
    eff = _efficiency(names, best.x, prior)
    predicted, _ = _predict(dep, eff, samples)
    errors = np.abs(predicted / measured - 1.0)
    by_kind = {kind: float(np.mean([e for e, s in zip(errors, samples) if s.kind == kind]))
               for kind in sorted({s.kind for s in samples})}
    mape = float(np.mean(errors))
    eff = dataclasses.replace(eff, calibrated=True, source=source, step_time_mape=mape)
    return FitResult(eff, tuple(float(p) for p in predicted), mape, by_kind, names)
