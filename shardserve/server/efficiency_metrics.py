"""Live efficiency metrics of a replica: what an operator watches to see how well the hardware is
used and what tokens cost at the current load.

    shardserve:mfu                          FLOPs done / (window x peak FLOP/s), per device
    shardserve:mbu                          weight + KV bytes read / (window x memory bandwidth)
    shardserve:cost_per_million_tokens_usd  device-hours of the replica over the window / output
                                            tokens in it (NaN when the window saw no token)
    shardserve:step_time_seconds{kind}      engine step wall time, kind = prefill | decode | mixed

All from the engine's own step records (`LLMEngine.last_step`: the batch and the step's wall
time) and the planner cost model's FLOP and byte counts (`cost_model.step_work`, the profiler's
too); no profiler runs in the serving path. The gauges are computed when scraped, over the last
`window_s` seconds of wall time (shorter right after start), so idle time lowers MFU and raises
the cost per token: these are utilization at the current load, not the speed of a busy step.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, Histogram

from shardserve.engine.interface import StepRecord
from shardserve.planner.cost_model import Deployment, step_work

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


@dataclass(frozen=True)
class EfficiencyConfig:
    """The replica as the cost model sees it (model, layout, dtype, device peaks) and its price."""

    deployment: Deployment
    price_per_device_hour_usd: float = 0.0
    window_s: float = 30.0


def step_kind(batch: tuple[tuple[int, int], ...]) -> str:
    has_prefill = any(num_tokens > 1 for num_tokens, _ in batch)
    has_decode = any(num_tokens == 1 for num_tokens, _ in batch)
    return "mixed" if has_prefill and has_decode else "prefill" if has_prefill else "decode"


class LiveEfficiency:
    """Registers the metrics on `registry`; `observe` is called on the engine thread after each
    step, the gauges are read on the HTTP thread at scrape time (a lock guards the window)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, config: EfficiencyConfig):
        self.config = config
        dep = config.deployment
        self._peak_flop_s = dep.hardware.peak_flop_s_for(dep.dtype)
        self._bandwidth = dep.hardware.memory_bandwidth_bytes_s
        self._devices = dep.parallel.world_size
        self._stages = dep.parallel.pp_size
        self._window: collections.deque = collections.deque()  # (end time, flops, bytes, output tokens)
        self._lock = threading.Lock()
        self._started = time.monotonic()
        labels = ["model_name"]
        self.step_time = Histogram("shardserve:step_time_seconds", "Engine step wall time by step kind",
                                   labels + ["kind"], buckets=_STEP_BUCKETS_S, registry=registry)
        for kind in ("prefill", "decode", "mixed"):
            self.step_time.labels(model_name, kind)
        gauges = (("shardserve:mfu", "Model FLOPs utilization per device over the recent window", self.mfu),
                  ("shardserve:mbu", "Memory bandwidth utilization per device over the recent window", self.mbu),
                  ("shardserve:cost_per_million_tokens_usd", "Device cost per million output tokens at the "
                   "current load (recent window)", self.cost_per_million_tokens_usd))
        for name, doc, fn in gauges:
            Gauge(name, doc, labels, registry=registry).labels(model_name).set_function(fn)
        self.model_name = model_name

    def observe(self, record: StepRecord, num_output_tokens: int) -> None:
        if not record.batch:
            return
        work = step_work(self.config.deployment, record.batch)
        now = time.monotonic()
        self.step_time.labels(self.model_name, step_kind(record.batch)).observe(record.duration_s)
        with self._lock:
            # per device: a pipeline's stages each do their share of the step's work
            self._window.append((now, work.flops / self._stages, work.bytes / self._stages, num_output_tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.config.window_s:
            self._window.popleft()

    def _totals(self) -> tuple[float, float, float, int]:
        """(window seconds, FLOPs, bytes, output tokens) of the recent window."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            flops = sum(e[1] for e in self._window)
            num_bytes = sum(e[2] for e in self._window)
            tokens = sum(e[3] for e in self._window)
        return max(1e-9, min(self.config.window_s, now - self._started)), flops, num_bytes, tokens

    def mfu(self) -> float:
        window_s, flops, _, _ = self._totals()
        return flops / (window_s * self._peak_flop_s)

    def mbu(self) -> float:
        window_s, _, num_bytes, _ = self._totals()
        return num_bytes / (window_s * self._bandwidth)

    def cost_per_million_tokens_usd(self) -> float:
        window_s, _, _, tokens = self._totals()
        price = self.config.price_per_device_hour_usd * self._devices
        if price == 0:
            return 0.0
        if tokens == 0:
            return math.nan
        return price * window_s / 3600 / tokens * 1e6


PROBE_COPY_BYTES = 64 * 2**20  # replica_hardware's copy


def replica_hardware(engine_config, calibration_path: str | None = None):
    """The peaks the replica's efficiency is measured against: the hardware a profiler
    calibration file recorded (`shardserve profile`), else a quick probe of this host (1024^3
    matmuls and a 64 MiB copy, about 0.2 s on a 2-core CPU). The probe reads lower than the
    profiler's peaks (which are raised to the best rates the engine reached), so without a
    calibration MFU can read high, even above 1. The server probes before it loads the model;
    the copy still needs its source and destination at once, which a small replica's peak
    memory carries (a 256 MiB copy made SmolLM2 Q4_1's server peak 861 MiB, 46 MiB above what
    it holds serving). 64 MiB is twice this dev host's last-level cache; a CPU with a larger one
    reads a higher bandwidth than its memory gives (a calibration file measures it properly)."""
    from shardserve.planner.efficiency import load_calibration
    from shardserve.planner.hardware import measure_this_host

    if calibration_path:
        calibration = load_calibration(calibration_path)
        for name in calibration.device_names:
            found = calibration.hardware_for(name)
            if found is not None and engine_config.dtype in found.peak_flop_s:
                return found
    return measure_this_host(engine_config.dtype, engine_config.device, matmul_size=1024,
                             num_copy_bytes=PROBE_COPY_BYTES)


def efficiency_config(engine_config, model_config, hardware, price_per_device_hour_usd: float | None = None,
                      weight_bytes_per_param: float | None = None) -> EfficiencyConfig:
    """The replica's EfficiencyConfig against `hardware` (replica_hardware), its weights counted at
    `weight_bytes_per_param` (the engine's; None: --dtype's). Price: the flag, else the hardware
    entry's, else 0 (a measured host has no catalog price)."""
    import dataclasses

    price = hardware.price_per_hour_usd if price_per_device_hour_usd is None else price_per_device_hour_usd
    if price < 0:
        from shardserve.config import ConfigError

        raise ConfigError(f"--device-price-per-hour must be >= 0, got {price}")
    # links do not enter the FLOP and byte counts; a measured host has none, so give it nominal ones
    if engine_config.parallel.world_size > 1 and hardware.intra_node_bandwidth_bytes_s <= 0:
        hardware = dataclasses.replace(hardware, intra_node_bandwidth_bytes_s=hardware.memory_bandwidth_bytes_s,
                                       devices_per_node=engine_config.parallel.world_size)
    dep = Deployment(model_config, engine_config.parallel, hardware, engine_config.dtype,
                     weight_bytes_per_param=weight_bytes_per_param)
    return EfficiencyConfig(dep, price)
