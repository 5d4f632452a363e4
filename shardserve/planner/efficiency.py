"""Efficiency factors of the cost model (achieved fraction of peak per op class) and the
calibration file the profiler writes.

Calibration file (JSON, format "shardserve-efficiency/1"); one entry per device, keyed by its
catalog name or alias, every factor optional (a missing one keeps the prior):

    {
      "format": "shardserve-efficiency/1",
      "source": "shardserve profile --model ... on 8x H100 SXM, 2025-06-01",
      "devices": {
        "H100 SXM": {
          "dtype": "bfloat16",
          "gemm": 0.62, "attention": 0.45, "memory": 0.83, "network": 0.71,
          "step_overhead_s": 0.0015,
          "num_samples": 240,
          "step_time_mape": 0.08
        }
      }
    }

`num_samples` (profiled steps the fit used) and `step_time_mape` (mean absolute percentage error
of the fitted model on those steps) are reported, not used. A device absent from the file stays
uncalibrated, and plans say so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardserve.config import ConfigError
from shardserve.planner.hardware import normalize_device_name

CALIBRATION_FORMAT = "shardserve-efficiency/1"
_FACTORS = ("gemm", "attention", "memory", "network")


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak per op class, and a fixed cost per engine step.

    Defaults are uncalibrated priors from the literature (docs/planning.md):
    gemm 0.7 ("up to 0.7 for inference", llm-analysis); attention 0.5 (FlashAttention-2 forward
    reaches ~50-70% of peak; decode attention is memory-bound anyway); memory 0.8 (aiconfigurator's
    empirical HBM scaling factor); network 0.7 (NCCL ring bus bandwidth vs link peak);
    step_overhead_s 2 ms (scheduling, input prep, sampling, launches per Python engine step)."""

    gemm: float = 0.7
    attention: float = 0.5
    memory: float = 0.8
    network: float = 0.7
    step_overhead_s: float = 2e-3
    calibrated: bool = False
    source: str = ""  # where calibrated factors came from
    step_time_mape: float | None = None  # the fit's own error on the profiled steps

    def __post_init__(self) -> None:
        for name in _FACTORS:
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"Efficiency.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.step_overhead_s < 0:
            raise ConfigError("Efficiency.step_overhead_s must be >= 0")

    @property
    def label(self) -> str:
        if not self.calibrated:
            return "uncalibrated"
        error = f", fit error {self.step_time_mape:.0%}" if self.step_time_mape is not None else ""
        return f"calibrated ({self.source or 'calibration file'}{error})"


@dataclass(frozen=True)
class Calibration:
    """Calibrated efficiencies by device name; `for_device` falls back to the priors."""

    source: str
    by_device: tuple[tuple[str, Efficiency], ...]

    def for_device(self, device_name: str, aliases: tuple[str, ...] = ()) -> Efficiency:
        names = {normalize_device_name(n) for n in (device_name, *aliases)}
        for name, eff in self.by_device:
            if normalize_device_name(name) in names:
                return eff
        return Efficiency()


def _device_efficiency(name: str, entry: Any, source: str) -> Efficiency:
    if not isinstance(entry, dict):
        raise ConfigError(f"calibration: device {name!r} must map to an object of factors")
    values: dict[str, Any] = {}
    for key in (*_FACTORS, "step_overhead_s", "step_time_mape"):
        if key in entry:
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"calibration: device {name!r} field {key!r} is not a number: {value!r}")
            values[key] = float(value)
    return replace(Efficiency(), calibrated=True, source=source, **values)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file (format in the module docstring). ConfigError on anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read calibration file {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ConfigError(f"calibration file {path}: expected \"format\": \"{CALIBRATION_FORMAT}\"")
    devices = data.get("devices")
    if not isinstance(devices, dict) or not devices:
        raise ConfigError(f"calibration file {path}: expected a non-empty \"devices\" object")
    source = str(data.get("source") or path.name)
    try:
        effs = tuple((str(name), _device_efficiency(str(name), entry, source)) for name, entry in devices.items())
    except ConfigError as exc:  # out-of-range factors: say which file
        raise ConfigError(f"calibration file {path}: {exc}") from None
    return Calibration(source=source, by_device=effs)
