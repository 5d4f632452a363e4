"""Efficiency factors of the cost model (achieved fraction of peak per op class), host overhead
terms, and the calibration file the profiler writes (`shardserve profile`, docs/profiling.md).

Calibration file (JSON); one entry per device, keyed by its catalog name or alias, every factor
optional (a missing one keeps the prior):

    {
      "format": "shardserve-efficiency/2",
      "source": "shardserve profile smollm2 (float32, tp1 pp1 ep1) on this host, 2026-11-29",
      "devices": {
        "this host": {
          "dtype": "float32",
          "gemm": 0.62, "attention": 0.45, "memory": 0.83, "network": 0.7,
          "step_overhead_s": 0.0015, "seq_overhead_s": 4e-05, "token_overhead_s": 2e-06,
          "decode_attention": 0.2, "overlap": 0.3, "kv_memory": 0.6,
          "num_samples": 24,
          "step_time_mape": 0.08,
          "hardware": {"name": "this host", "vendor": "measured", "peak_flop_s": {"float32": 1.9e11}, ...}
        }
      }
    }

Versions: "/1" has the four factors and `step_overhead_s`; "/2" adds `seq_overhead_s` and
`token_overhead_s` (host work per sequence and per new token of a step: scheduling, input
preparation, sampling, detokenization, and the elementwise work the roofline leaves out),
`decode_attention` (the attention factor of decode tokens; null: same as `attention`),
`kv_memory` (the memory factor of KV-cache reads; null: same as `memory`),
`overlap` (1: the classic roofline max of compute and memory time; lower: part of the shorter
adds on, as on a CPU), `activation_traffic` (the share of the cost model's activation traffic
the fit counts; absent: 0, as fits before it had none) and the optional `hardware` object. Both
versions are read; the fields a "/1" file lacks keep the defaults a "/1" fit assumed (0, null, 1).

`hardware` (catalog fields, see hardware_catalog.yaml) records the peaks the factors were fitted
against. A measured host is not in the catalog and its measured peaks vary from run to run, so a
consumer of the factors (the planner, the simulator) must pair them with these peaks:
`Calibration.hardware_for`. `num_samples` (profiled steps the fit used) and `step_time_mape`
(mean absolute percentage error of the fitted model on those steps) are reported, not used. A
device absent from the file stays uncalibrated, and plans say so.

`dtype` is the dtype the factors were fitted in: they hold for that dtype only (an fp8 GEMM
reaches another fraction of its peak than a bf16 one), so a plan in another dtype stays
uncalibrated. One device may have an entry per dtype, keyed "NAME@DTYPE" (e.g. "h100@float8").
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardserve.config import ConfigError
from shardserve.planner.hardware import Hardware, hardware_from_dict, hardware_to_dict, normalize_device_name

CALIBRATION_FORMAT = "shardserve-efficiency/2"
READABLE_FORMATS = ("shardserve-efficiency/1", CALIBRATION_FORMAT)
_FACTORS = ("gemm", "attention", "memory", "network")
_OVERHEADS = ("step_overhead_s", "seq_overhead_s", "token_overhead_s")
_V2_FIELDS = ("decode_attention", "overlap", "kv_memory", "activation_traffic")
_OPTIONAL = ("decode_attention", "kv_memory")  # null: the factor they refine
FITTED_WITHOUT_OVERLAP = 1.0  # what a calibration entry without "overlap" was fitted with
FITTED_WITHOUT_ACTIVATION_TRAFFIC = 0.0  # ... and without "activation_traffic"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak per op class, and the host's fixed cost per engine step.

    Defaults are uncalibrated priors from the literature (docs/planning.md):
    gemm 0.6 (sustained dense tensor-core GEMM at the board's power limit on the shapes a
    serving step runs -- a few thousand tokens by a TP slice of the model -- is about 60-65% of
    the datasheet peak on A100 and H100/H200, bf16 and fp8 alike, in public cuBLAS
    microbenchmarks; the 70%+ figures are for large square GEMMs at boost clocks); attention 0.5
    (FlashAttention-2 forward reaches ~50-70% of peak; decode attention is memory-bound anyway);
    memory 0.8 (aiconfigurator's empirical HBM scaling factor); network 0.7 (NCCL ring bus bandwidth vs link peak);
    step_overhead_s 2 ms (scheduling, input prep, sampling, launches per Python engine step).

    A step's host overhead is `step_overhead_s + seq_overhead_s * sequences + token_overhead_s *
    new tokens` (`overhead_s`): the priors put it all in the constant; a calibration fitted on a
    CPU host, where per-sequence sampling and detokenization and per-token elementwise work are
    not negligible, sets the other two (see shardserve/profiler/calibration_fit.py).

    `decode_attention` is the attention factor of decode tokens (one query per sequence: a
    different, memory-streaming kernel from a prefill chunk's); None uses `attention`.
    `overlap` is how much of the shorter of an op class's compute and memory time hides under
    the longer (cost_model.roof_s): 1 is the classic roofline; the prior 0.62 is what DeepGEMM's
    published H800 fp8 GEMMs of decode shape give with the gemm and memory priors above (M = 128,
    N = 4096 x K = 7168 and N = 7168 x K = 2048: 533 and 510 TFLOPS, 2.22 and 2.28 TB/s, i.e.
    27% of peak compute and 66-68% of peak bandwidth at once, where a max of the two would put
    the bandwidth at 80%: overlap 0.62 and 0.65); a CPU's fitted overlap is lower still, its
    time nearer the sum of the two.
    `kv_memory` is the memory factor of KV-cache reads: paged, per-sequence and scattered in
    pages, they stream at another rate than the weights' long contiguous reads; None uses
    `memory`.
    `activation_traffic` scales the cost model's activation traffic (activation_traffic.py: the
    kernels between the GEMMs streaming each token's activations through device memory): 1 for a
    GPU, whose batches' activations outgrow its cache; 0 in a calibration fitted with a per-token
    host term, which already carries that elementwise work (a CPU's activations mostly stay in
    its caches)."""

    gemm: float = 0.6
    attention: float = 0.5
    memory: float = 0.8
    network: float = 0.7
    step_overhead_s: float = 2e-3
    seq_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    decode_attention: float | None = None
    overlap: float = 0.62
    kv_memory: float | None = None
    activation_traffic: float = 1.0
    calibrated: bool = False
    source: str = ""  # where calibrated factors came from
    step_time_mape: float | None = None  # the fit's own error on the profiled steps
    dtype: str | None = None  # the dtype the factors were fitted in (None: any)

    def __post_init__(self) -> None:
        for name in _FACTORS:
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"Efficiency.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in _OVERHEADS:
            if getattr(self, name) < 0:
                raise ConfigError(f"Efficiency.{name} must be >= 0")
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"Efficiency.{name} must be in (0, 1], got {value}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"Efficiency.overlap must be in [0, 1], got {self.overlap}")
        if not self.activation_traffic >= 0:
            raise ConfigError(f"Efficiency.activation_traffic must be >= 0, got {self.activation_traffic}")

    @property
    def decode_attention_factor(self) -> float:
        return self.attention if self.decode_attention is None else self.decode_attention

    @property
    def kv_memory_factor(self) -> float:
        return self.memory if self.kv_memory is None else self.kv_memory

    def overhead_s(self, num_seqs: float, num_tokens: float) -> float:
        """Host time of a step of `num_seqs` sequences computing `num_tokens` new tokens."""
        return self.step_overhead_s + self.seq_overhead_s * num_seqs + self.token_overhead_s * num_tokens

    def priors_text(self) -> str:
        """The factors a plan without calibration runs on, as the CLIs print them."""
        return (f"gemm {self.gemm:g}, attention {self.attention:g}, memory {self.memory:g}, network {self.network:g}, "
                f"overlap {self.overlap:g}, {self.step_overhead_s * 1e3:g} ms per step")

    @property
    def label(self) -> str:
        if not self.calibrated:
            return "uncalibrated"
        error = f", fit error {self.step_time_mape:.0%}" if self.step_time_mape is not None else ""
        return f"calibrated ({self.source or 'calibration file'}{error})"


@dataclass(frozen=True)
class Calibration:
    """Calibrated efficiencies by device name; `for_device` falls back to the priors.
    `hardware_by_device` holds the peaks each device's factors were fitted against, where the
    file recorded them (always, for files the profiler writes)."""

    source: str
    by_device: tuple[tuple[str, Efficiency], ...]
    hardware_by_device: tuple[tuple[str, Hardware], ...] = ()

    def for_device(self, device_name: str, aliases: tuple[str, ...] = (), dtype: str | None = None) -> Efficiency:
        """The device's factors fitted in `dtype` (or in no stated dtype), else the priors."""
        matching = [(name, eff) for name, eff in self.by_device
                    if dtype is None or eff.dtype is None or eff.dtype == dtype]
        return _lookup(matching, device_name, aliases) or Efficiency()

    def hardware_for(self, device_name: str, aliases: tuple[str, ...] = ()) -> Hardware | None:
        """The device as the profiler saw it (measured or catalog peaks), or None."""
        return _lookup(self.hardware_by_device, device_name, aliases)

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.by_device)


def _lookup(pairs, device_name: str, aliases: tuple[str, ...]):
    names = {normalize_device_name(n) for n in (device_name, *aliases)}
    for name, value in pairs:
        if normalize_device_name(name.partition("@")[0]) in names:  # "NAME@DTYPE" keys name NAME
            return value
    return None


def _device_efficiency(name: str, entry: Any, source: str) -> Efficiency:
    if not isinstance(entry, dict):
        raise ConfigError(f"calibration: device {name!r} must map to an object of factors")
    values: dict[str, Any] = {}
    for key in (*_FACTORS, *_OVERHEADS, *_V2_FIELDS, "step_time_mape"):
        if key in entry and not (key in _OPTIONAL and entry[key] is None):
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"calibration: device {name!r} field {key!r} is not a number: {value!r}")
            values[key] = float(value)
    dtype = entry.get("dtype") or (name.partition("@")[2] or None)
    if dtype is not None and not isinstance(dtype, str):
        raise ConfigError(f"calibration: device {name!r} field 'dtype' is not a dtype name: {dtype!r}")
    # a fit that wrote no overlap (a "/1" file) assumed the classic roofline, not today's prior
    values.setdefault("overlap", FITTED_WITHOUT_OVERLAP)
    values.setdefault("activation_traffic", FITTED_WITHOUT_ACTIVATION_TRAFFIC)
    return replace(Efficiency(), calibrated=True, source=source, dtype=dtype, **values)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file (format in the module docstring). ConfigError on anything else."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read calibration file {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"calibration file {path}: expected \"format\": \"{CALIBRATION_FORMAT}\" "
                          f"(or an older {', '.join(READABLE_FORMATS[:-1])})")
    devices = data.get("devices")
    if not isinstance(devices, dict) or not devices:
        raise ConfigError(f"calibration file {path}: expected a non-empty \"devices\" object")
    source = str(data.get("source") or path.name)
    try:
        effs = tuple((str(name), _device_efficiency(str(name), entry, source)) for name, entry in devices.items())
        hardware = tuple((str(name), hardware_from_dict(entry["hardware"])) for name, entry in devices.items()
                         if isinstance(entry, dict) and "hardware" in entry)
    except ConfigError as exc:  # out-of-range factors, a malformed hardware entry: say which file
        raise ConfigError(f"calibration file {path}: {exc}") from None
    return Calibration(source=source, by_device=effs, hardware_by_device=hardware)


def calibration_document(source: str, device_name: str, efficiency: Efficiency, hardware: Hardware,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document (current format) for one device's fitted factors; `extra` adds reported
    fields to the device entry (e.g. dtype, num_samples, the fit's residuals)."""
    entry: dict[str, Any] = {name: getattr(efficiency, name) for name in (*_FACTORS, *_OVERHEADS, *_V2_FIELDS)}
    if efficiency.step_time_mape is not None:
        entry["step_time_mape"] = efficiency.step_time_mape
    entry.update(extra or {})
    entry["hardware"] = hardware_to_dict(hardware)
    return {"format": CALIBRATION_FORMAT, "source": source, "devices": {device_name: entry}}
