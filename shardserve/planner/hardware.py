"""Accelerator descriptions for the planner: the catalog, name lookup, overrides and what-ifs.

Figures come from `hardware_catalog.yaml` (public datasheets, each device lists its sources);
`measure_this_host` builds one for the machine we are running on.
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardserve.config import ConfigError
from shardserve.dtypes import ENGINE_DTYPES

CATALOG_PATH = Path(__file__).with_name("hardware_catalog.yaml")

_NUMBER_FIELDS = (
    "memory_bytes", "memory_bandwidth_bytes_s", "intra_node_bandwidth_bytes_s", "intra_node_latency_s",
    "inter_node_bandwidth_bytes_s", "inter_node_latency_s", "devices_per_node", "power_w",
    "price_per_hour_usd",
)
# Links may be absent (0 bandwidth) on a single host; everything else must be positive.
_MAY_BE_ZERO = frozenset({
    "intra_node_bandwidth_bytes_s", "intra_node_latency_s", "inter_node_bandwidth_bytes_s",
    "inter_node_latency_s", "power_w", "price_per_hour_usd",
})


@dataclass(frozen=True)
class Hardware:
    """One accelerator (per-device figures). Bandwidths are per direction; `peak_flop_s` maps a
    dtype name ("bfloat16", "float16", "float8", "float32") to its dense peak. Not hashable
    (holds a dict); compare by value."""

    name: str
    vendor: str
    peak_flop_s: dict[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_s: float
    intra_node_bandwidth_bytes_s: float
    intra_node_latency_s: float
    inter_node_bandwidth_bytes_s: float
    inter_node_latency_s: float
    devices_per_node: int
    power_w: float
    price_per_hour_usd: float
    sources: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    notes: str = ""

    def peak_flop_s_for(self, dtype: str) -> float:
        """Dense peak for `dtype`; ConfigError when the device has no native path for it."""
        if dtype not in self.peak_flop_s:
            have = ", ".join(sorted(self.peak_flop_s))
            raise ConfigError(f"{self.name} has no {dtype} peak in the catalog (has: {have})")
        return self.peak_flop_s[dtype]


def normalize_device_name(name: str) -> str:
    # "H100 SXM", "h100-sxm" and "h100_sxm" all name the same device.
    return re.sub(r"[^a-z0-9.]", "", name.lower())


_UNITS = {"GiB": 2**30, "GB": 1e9, "TiB": 2**40, "TB": 1e12}


def _as_number(value: Any) -> Any:
    # PyYAML (YAML 1.1) reads "80.0e9" (no exponent sign) as a string; accept it as a number, and
    # a capacity with its unit ("80 GiB": the catalog writes memory as the datasheets size it)
    if isinstance(value, str):
        number, _, unit = value.strip().partition(" ")
        try:
            return float(number) * _UNITS[unit.strip()] if unit else float(number)
        except (ValueError, KeyError):
            return value
    return value


def _device_from_entry(entry: Any, index: int, needs_bfloat16: bool = True) -> Hardware:
    if not isinstance(entry, dict):
        raise ConfigError(f"hardware catalog: device #{index} is not a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"hardware catalog: device #{index} has no 'name'")
    for key in ("vendor", "peak_flop_s", "sources", *_NUMBER_FIELDS):
        if key not in entry:
            raise ConfigError(f"hardware catalog: device {name!r} is missing field {key!r}")
    peaks = entry["peak_flop_s"]
    if not isinstance(peaks, dict) or not peaks or (needs_bfloat16 and "bfloat16" not in peaks):
        what = "a bfloat16 entry" if needs_bfloat16 else "at least one dtype"
        raise ConfigError(f"hardware catalog: device {name!r} field 'peak_flop_s' needs {what}")
    peaks = {dtype: _as_number(v) for dtype, v in entry["peak_flop_s"].items()}
    numbers: dict[str, float] = {}
    for key in _NUMBER_FIELDS:
        value = _as_number(entry[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"hardware catalog: device {name!r} field {key!r} is not a number: {value!r}")
        if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
            raise ConfigError(f"hardware catalog: device {name!r} field {key!r} must be positive, got {value!r}")
        numbers[key] = value
    for dtype, value in peaks.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"hardware catalog: device {name!r} peak_flop_s.{dtype} must be a positive number")
    sources = entry["sources"]
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"hardware catalog: device {name!r} field 'sources' must be a non-empty list of strings")
    numbers["memory_bytes"] = int(numbers["memory_bytes"])
    numbers["devices_per_node"] = int(numbers["devices_per_node"])
    return Hardware(
        name=name, vendor=str(entry["vendor"]), peak_flop_s={k: float(v) for k, v in peaks.items()},
        sources=tuple(sources), aliases=tuple(str(a) for a in entry.get("aliases") or ()),
        notes=str(entry.get("notes") or ""), **numbers,
    )


def hardware_from_dict(entry: Any) -> Hardware:
    """A device from one catalog-format mapping (as `hardware_to_dict` writes it); ConfigError
    naming the field when it is incomplete. Unlike a catalog entry it may lack a bfloat16 peak
    (a host measured in float32 has only that one)."""
    return _device_from_entry(entry, 0, needs_bfloat16=False)


def hardware_to_dict(hw: Hardware) -> dict[str, Any]:
    """`hw` as a catalog-format mapping (JSON- and YAML-safe)."""
    entry: dict[str, Any] = {"name": hw.name, "vendor": hw.vendor, "aliases": list(hw.aliases),
                             "peak_flop_s": dict(hw.peak_flop_s)}
    entry.update({key: getattr(hw, key) for key in _NUMBER_FIELDS})
    entry.update(sources=list(hw.sources) or ["unknown"], notes=hw.notes)
    return entry


def load_catalog(path: str | Path | None = None) -> dict[str, Hardware]:
    """Read a catalog file (the packaged one by default) into {name: Hardware}.

    Raises ConfigError naming the device and field when an entry is incomplete or malformed."""
    path = Path(path) if path is not None else CATALOG_PATH
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read hardware catalog {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise ConfigError(f"hardware catalog {path}: expected a top-level 'devices:' list")
    catalog: dict[str, Hardware] = {}
    for index, entry in enumerate(data["devices"]):
        hw = _device_from_entry(entry, index)
        if hw.name in catalog:
            raise ConfigError(f"hardware catalog {path}: device {hw.name!r} appears twice")
        catalog[hw.name] = hw
    return catalog


def get_hardware(name: str, catalog: dict[str, Hardware] | None = None) -> Hardware:
    """Look a device up by name or alias, ignoring case, spaces, dashes and underscores."""
    catalog = catalog if catalog is not None else load_catalog()
    wanted = normalize_device_name(name)
    for hw in catalog.values():
        if wanted in {normalize_device_name(hw.name), *(normalize_device_name(a) for a in hw.aliases)}:
            return hw
    known = ", ".join(sorted(catalog))
    raise ConfigError(f"unknown hardware {name!r}; known: {known}")


# what-if key -> Hardware field; "flops" scales every dtype's peak.
_WHAT_IF_FIELDS = {
    "mem_bw": "memory_bandwidth_bytes_s",
    "memory": "memory_bytes",
    "price": "price_per_hour_usd",
    "power": "power_w",
    "intra_bw": "intra_node_bandwidth_bytes_s",
    "inter_bw": "inter_node_bandwidth_bytes_s",
    "flops": "peak_flop_s",
}


def _parse_factor(term: str, text: str) -> float:
    text = text.strip().lower()
    text = text[:-1] if text.endswith("x") else text
    try:
        factor = float(text)
    except ValueError:
        raise ConfigError(f"what-if term {term!r}: {text!r} is not a factor like 1.5x") from None
    if not factor > 0:
        raise ConfigError(f"what-if term {term!r}: the factor must be positive")
    return factor


def apply_what_if(hw: Hardware, spec: str) -> Hardware:
    """Scale figures of `hw` by factors, e.g. "mem_bw=2x,flops=1.5x,memory=1.5x,price=0.8x".

    Keys: mem_bw, memory, flops (all dtypes), price, power, intra_bw, inter_bw. The result's
    name records the spec. An empty spec returns `hw` unchanged."""
    changes: dict[str, Any] = {}
    for term in (t.strip() for t in spec.split(",")):
        if not term:
            continue
        key, sep, value = term.partition("=")
        key = key.strip().lower()
        if not sep or key not in _WHAT_IF_FIELDS:
            keys = ", ".join(sorted(_WHAT_IF_FIELDS))
            raise ConfigError(f"bad what-if term {term!r}; expected KEY=FACTORx with KEY one of {keys}")
        factor = _parse_factor(term, value)
        target = _WHAT_IF_FIELDS[key]
        if target == "peak_flop_s":
            changes[target] = {d: v * factor for d, v in hw.peak_flop_s.items()}
        elif target == "memory_bytes":
            changes[target] = int(round(hw.memory_bytes * factor))
        else:
            changes[target] = getattr(hw, target) * factor
    if not changes:
        return hw
    return dataclasses.replace(hw, name=f"{hw.name} (what-if {spec.strip()})", **changes)


def measure_this_host(dtype: str = "bfloat16", device: str | None = None, matmul_size: int = 2048,
                      num_copy_bytes: int = 256 * 2**20) -> Hardware:
    """Measure this machine: a `matmul_size`^3 matmul for FLOP/s and a `num_copy_bytes` copy for
    memory bandwidth (read + write bytes per second), best of three after a warm-up. Uses CUDA
    when available unless `device` says otherwise. No network links (0 bandwidth) and price 0.
    Smaller sizes make a quicker, lower estimate (a server's live MFU uses 1024 and 64 MiB)."""
    import psutil
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype not in ENGINE_DTYPES:  # a dtype torch can multiply in
        raise ConfigError(f"measure_this_host: unsupported dtype {dtype!r} ({', '.join(ENGINE_DTYPES)})")
    torch_dtype = getattr(torch, dtype)

    def best_time_s(fn) -> float:
        fn()  # warm-up: allocator, kernel selection, page faults
        timings = []
        for _ in range(3):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            timings.append(time.perf_counter() - start)
        return min(timings)

    size = matmul_size
    a = torch.randn(size, size, device=device).to(torch_dtype)
    b = torch.randn(size, size, device=device).to(torch_dtype)
    packed = None
    if device == "cpu":
        # The engine's linears run on prepacked weights (our panel kernel where the CPU has one for
        # the dtype, else oneDNN's layout): time the engine's path. torch.mm's is up to 2.4x slower
        # (200 vs 470 GFLOP/s in float32 on the 2-core dev VM), and in bf16 on a CPU without bf16
        # instructions 100x slower (1 GFLOP/s: 9 s of a server's start on such a host).
        from shardserve.layers.linear import prepack_weight

        packed = prepack_weight(b)
    if packed is not None:
        flop_s = 2 * size**3 / best_time_s(lambda: packed.linear(a, None))
    else:
        flop_s = 2 * size**3 / best_time_s(lambda: torch.mm(a, b))
    src = torch.ones(num_copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bytes_s = 2 * num_copy_bytes / best_time_s(lambda: dst.copy_(src))
    if device.startswith("cuda"):
        memory_bytes = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        memory_bytes = psutil.virtual_memory().total
    return Hardware(
        name="this host", vendor="measured", peak_flop_s={dtype: flop_s}, memory_bytes=int(memory_bytes),
        memory_bandwidth_bytes_s=copy_bytes_s, intra_node_bandwidth_bytes_s=0.0, intra_node_latency_s=0.0,
        inter_node_bandwidth_bytes_s=0.0, inter_node_latency_s=0.0, devices_per_node=1, power_w=0.0,
        price_per_hour_usd=0.0,
        sources=(f"measured on {device}: {'the prepacked linear' if packed is not None else 'torch.mm'} at {size}^3, "
                 f"and a {num_copy_bytes / 2**20:g} MiB copy",),
        notes="measured peaks are achieved figures, so efficiency factors near 1 apply",
    )
