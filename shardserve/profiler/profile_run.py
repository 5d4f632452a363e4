"""A whole profile: size the engine for the sweep, take the device's peaks, measure every sweep
point, compute work, MFU / MBU and bottlenecks, fit the cost model, write the three files.

Peaks: a catalog device's datasheet figures (`device_name`), or this host measured with
`planner.hardware.measure_this_host` before the engine starts. A measured probe (one large
matmul, one copy) can read below what the engine's own kernels reach, and efficiency factors
must stay at or below 1, so each peak is raised to the best rate any profiled op class achieved
(the hardware's notes say so). The calibration file records the hardware it was fitted against.

A parallel layout on a measured host has no link figures: the links get nominal ones (the host's
memory bandwidth, 20 us per ring step, all ranks on one node) that the fitted network factor then
scales, and the file records them too.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import sys
from dataclasses import dataclass

from tqdm import tqdm

from shardserve.config import EngineConfig, ModelConfig
from shardserve.dtypes import dtype_bytes_of
from shardserve.engine.launcher import build_engine
from shardserve.engine.thread_governor import available_threads
from shardserve.planner.cost_model import Deployment, step_time
from shardserve.planner.efficiency import Efficiency, calibration_document
from shardserve.planner.hardware import Hardware, get_hardware, measure_this_host
from shardserve.profiler.calibration_fit import FitResult, FitSample, fit_efficiency
from shardserve.profiler.controlled_steps import ControlledBatches
from shardserve.profiler.report import ProfileRow
from shardserve.profiler.roofline import OpWork, bottleneck_of, bottleneck_shares, op_class_work, utilization
from shardserve.profiler.step_measure import PointMeasurement, measure_point
from shardserve.profiler.step_probe import StepProbe
from shardserve.profiler.sweep import SweepConfig, SweepPoint
from shardserve.request import SamplingParams

MEASURED_DEVICE = "this host"
_NOMINAL_LINK_LATENCY_S = 20e-6


@dataclass(frozen=True)
class ProfileConfig:
    sweep: SweepConfig
    device_name: str | None = None  # catalog device for the peaks; None: measure this host
    temperature: float = 0.0  # of the profiled requests; 0 (greedy) is what the benchmarks replay
    seed: int = 0
    show_progress: bool = True


@dataclass
class ProfileResult:
    rows: list[ProfileRow]
    deployment: Deployment  # the hardware the fit used, with the fitted efficiency
    fit: FitResult
    prior_mape: float  # the uncalibrated priors' error on the same steps
    device_name: str  # the calibration file's key
    source: str


def sweep_engine_config(config: EngineConfig, model: ModelConfig, points: list[SweepPoint],
                        sweep: SweepConfig) -> EngineConfig:
    """`config` with a token budget, sequence limit and KV pool large enough for every point, and
    a fixed thread count (the governor's probes would mix counts within a point's repeats)."""
    block_size = config.cache.block_size
    room = sweep.num_repeats + sweep.num_warmup_steps + 2  # decode steps taken at one point

    def blocks(num_tokens: int) -> int:
        return math.ceil(num_tokens / block_size)

    def point_blocks(p: SweepPoint) -> int:
        if p.kind == "prefill":
            return p.num_seqs * blocks(p.prompt_len)
        return p.num_seqs * blocks(p.context_len + room) + (blocks(p.prompt_len) if p.kind == "mixed" else 0)

    kv_bytes = (max(point_blocks(p) for p in points) + 8) * block_size * model.kv_bytes_per_token(
        dtype_bytes_of(config.dtype))
    scheduler = dataclasses.replace(
        config.scheduler,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens, max(p.num_step_tokens for p in points)),
        max_num_seqs=max(config.scheduler.max_num_seqs, max(p.num_step_seqs for p in points)))
    # committed up front: a step that first writes a block of a fresh pool pays its page faults
    # (a 512-token prefill 1.2x as long), which is the pool's start-up, not the step's cost
    cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=max(config.cache.kv_cache_memory_bytes or 0,
                                                                        kv_bytes), prefault_kv_cache=True)
    return dataclasses.replace(config, scheduler=scheduler, cache=cache,
                               cpu_threads=config.cpu_threads or available_threads())


def profile_hardware(config: EngineConfig, device_name: str | None) -> Hardware:
    if device_name is not None:
        return get_hardware(device_name)
    hw = measure_this_host(config.dtype, config.device)
    if config.parallel.world_size == 1:
        return hw
    return dataclasses.replace(hw, intra_node_bandwidth_bytes_s=hw.memory_bandwidth_bytes_s,
                               intra_node_latency_s=_NOMINAL_LINK_LATENCY_S,
                               devices_per_node=config.parallel.world_size,
                               notes=hw.notes + "; links: nominal (memory bandwidth, 20 us per ring step)")


def raise_peaks(dep: Deployment, measured: list[tuple[PointMeasurement, dict[str, OpWork]]]) -> Deployment:
    """`dep` with its peak FLOP/s and bandwidth raised to the best rates the GEMM and attention
    classes achieved, where those beat the hardware's figures."""
    hw = dep.hardware
    peak, bandwidth = hw.peak_flop_s_for(dep.dtype), hw.memory_bandwidth_bytes_s
    best_flop_s, best_bytes_s = peak, bandwidth
    for m, work in measured:
        for cls in ("gemm", "attention"):
            if m.class_s[cls] > 0:
                best_flop_s = max(best_flop_s, work[cls].flops / m.class_s[cls])
                best_bytes_s = max(best_bytes_s, work[cls].bytes / m.class_s[cls])
    if best_flop_s <= peak and best_bytes_s <= bandwidth:
        return dep
    note = (f"peaks raised to the best rates seen while profiling (probe: {peak / 1e9:.1f} GFLOP/s, "
            f"{bandwidth / 1e9:.1f} GB/s)")
    hw = dataclasses.replace(hw, peak_flop_s={**hw.peak_flop_s, dep.dtype: best_flop_s},
                             memory_bandwidth_bytes_s=best_bytes_s, notes=f"{hw.notes}; {note}".lstrip("; "))
    return dataclasses.replace(dep, hardware=hw)


def _measure_all(config: EngineConfig, points: list[SweepPoint],
                 profile: ProfileConfig) -> tuple[list[PointMeasurement], float | None]:
    """The points' measurements, and the bytes per weight parameter where the engine quantized them."""
    engine = build_engine(config)
    try:
        batches = ControlledBatches(engine, profile.seed, SamplingParams(temperature=profile.temperature))
        measurements = []
        with StepProbe(engine) as probe:
            progress = tqdm(points, desc="profile", unit="step", file=sys.stderr, disable=not profile.show_progress)
            for point in progress:
                progress.set_postfix_str(point.label)
                measurements.append(measure_point(probe, batches, point, profile.sweep))
        return measurements, engine.weight_bytes_per_param()
    finally:
        engine.shutdown()


def run_profile(config: EngineConfig, model: ModelConfig, profile: ProfileConfig) -> ProfileResult:
    """Profile `config`'s engine over `profile.sweep` and fit the cost model (see the module docstring)."""
    points = profile.sweep.points(config.max_model_len or model.max_position_embeddings)
    config = sweep_engine_config(config, model, points, profile.sweep)
    hardware = profile_hardware(config, profile.device_name)  # before the engine: no rank competes
    measurements, weight_bytes_per_param = _measure_all(config, points, profile)
    dep = Deployment(model, config.parallel, hardware, config.dtype, weight_bytes_per_param=weight_bytes_per_param)
    measured = [(m, op_class_work(dep, m.timing.batch)) for m in measurements]
    dep = raise_peaks(dep, measured)
    device_name = profile.device_name or MEASURED_DEVICE
    par = config.parallel
    source = (f"shardserve profile {config.model} ({config.dtype}, tp{par.tp_size} pp{par.pp_size} "
              f"ep{par.ep_size}) on {device_name}, {datetime.date.today().isoformat()}")
    samples = [FitSample(m.point.kind, m.timing.batch, m.timing.total_s,
                         sum(m.class_s[c] for c in ("elementwise", "sampling", "host"))) for m in measurements]
    fit = fit_efficiency(dep, samples, source)
    prior = [step_time(dep, s.batch).total_s for s in samples]
    prior_mape = sum(abs(p / s.measured_s - 1) for p, s in zip(prior, samples)) / len(samples)
    rows = []
    for (m, work), predicted_s in zip(measured, fit.predicted_s):
        mfu, mbu = utilization(dep, work, m.timing.total_s)
        shares = bottleneck_shares(dep, work, m.class_s)
        rows.append(ProfileRow(m, work, mfu, mbu, shares, bottleneck_of(shares), predicted_s))
    return ProfileResult(rows, dataclasses.replace(dep, efficiency=fit.efficiency), fit, prior_mape, device_name,
                         source)


def calibration_json(result: ProfileResult) -> dict:
    """The calibration file's document (planner.efficiency format) for this profile."""
    dep, fit = result.deployment, result.fit
    par = dep.parallel
    extra = {"dtype": dep.dtype, "layout": {"tp": par.tp_size, "pp": par.pp_size, "ep": par.ep_size},
             "num_samples": fit.num_samples, "step_time_mape_by_kind": fit.mape_by_kind,
             "uncalibrated_step_time_mape": result.prior_mape, "fitted": list(fit.fitted)}
    return calibration_document(result.source, result.device_name, dep.efficiency, dep.hardware, extra)


def describe_efficiency(eff: Efficiency) -> str:
    return (f"gemm {eff.gemm:.2f}, attention {eff.attention:.2f} (decode {eff.decode_attention_factor:.2f}), "
            f"memory {eff.memory:.2f}, network {eff.network:.2f}, overlap {eff.overlap:.2f}; host "
            f"{eff.step_overhead_s * 1e3:.2f} ms/step + {eff.seq_overhead_s * 1e3:.3f} ms/seq + "
            f"{eff.token_overhead_s * 1e3:.3f} ms/token")
