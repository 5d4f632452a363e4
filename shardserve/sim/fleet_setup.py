"""What a simulated replica is, resolved from names: the model, the device (a catalog entry, the
host a calibration file was profiled on, or this host measured now), the efficiency factors, and
the KV blocks the engine would allocate for the same memory budget.

The engine sizes its KV pool (engine/kv_cache.py, model_loader.py) as

    blocks = budget // (block_size * KV bytes per token on a rank)
    budget = --kv-cache-memory bytes, or a fraction (--kv-cache-memory-fraction; default 0.85 on an
             accelerator, 0.1 on a CPU host) of the memory free once the weights are loaded

and so does `engine_num_kv_blocks`, with the device's memory less the rank's weights standing in
for "free" on an accelerator, and this machine's available memory less the weights on a CPU host.
"""
from __future__ import annotations

from shardserve.config import ConfigError, ModelConfig, ParallelConfig
from shardserve.planner.cost_model import Deployment
from shardserve.planner.efficiency import Calibration, Efficiency, load_calibration
from shardserve.planner.hardware import Hardware, get_hardware, normalize_device_name
from shardserve.planner.memory_fit import kv_bytes_per_token_per_rank, weight_bytes_per_rank

THIS_HOST_NAMES = ("this-host", "this host")
_ACCELERATOR_FRACTION, _CPU_FRACTION = 0.85, 0.1  # the engine's defaults (CacheConfig)


def is_cpu_host(hw: Hardware) -> bool:
    """A host measured on its CPU (measure_this_host), where the engine budgets KV from RAM."""
    return hw.vendor == "measured" and any("on cpu" in source for source in hw.sources)


def resolve_hardware(name: str, dtype: str, calibration: Calibration | None) -> Hardware:
    """The device called `name`: as the calibration recorded it, else from the catalog; "this-host"
    is the host the calibration was profiled on, or this machine measured now (noisy: a calibration
    was fitted against its own measurement, so pass the file)."""
    recorded = getattr(calibration, "hardware_for", None)
    wanted = "this host" if normalize_device_name(name) in {normalize_device_name(n) for n in THIS_HOST_NAMES} else name
    if recorded is not None:
        hw = recorded(wanted)
        if hw is not None:
            return hw
    if wanted == "this host":
        from shardserve.planner.hardware import measure_this_host

        return measure_this_host(dtype)
    return get_hardware(name)


def resolve_deployment(model: ModelConfig, hardware: str, dtype: str, parallel: ParallelConfig,
                       calibration_path: str | None = None) -> Deployment:
    """A Deployment with calibrated efficiencies where `calibration_path` covers the device."""
    calibration = load_calibration(calibration_path) if calibration_path else None
    hw = resolve_hardware(hardware, dtype, calibration)
    efficiency = calibration.for_device(hw.name, hw.aliases, dtype) if calibration else Efficiency()
    return Deployment(model, parallel, hw, dtype, efficiency)


def engine_num_kv_blocks(dep: Deployment, block_size: int, max_model_len: int,
                         kv_cache_memory_bytes: int | None = None,
                         kv_cache_memory_fraction: float | None = None) -> int:
    """KV blocks per replica as the engine would allocate them (module docstring). ConfigError,
    worded like the engine's, when they cannot hold one full context."""
    dtype_bytes = dep.dtype_bytes
    block_bytes = kv_bytes_per_token_per_rank(dep.model, dep.parallel, dep.kv_bytes) * block_size
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    else:
        weights = weight_bytes_per_rank(dep.model, dep.parallel, dtype_bytes)
        if is_cpu_host(dep.hardware):
            import psutil

            free = psutil.virtual_memory().available - weights
            fraction = _CPU_FRACTION if kv_cache_memory_fraction is None else kv_cache_memory_fraction
        else:
            free = dep.hardware.memory_bytes - weights
            fraction = _ACCELERATOR_FRACTION if kv_cache_memory_fraction is None else kv_cache_memory_fraction
        budget = int(max(free, 0) * fraction)
    num_blocks = budget // block_bytes
    if num_blocks * block_size < max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_blocks * block_size} tokens, less than one full context of {max_model_len} "
            f"on {dep.hardware.name} ({dep.parallel.tp_size}x{dep.parallel.pp_size}x{dep.parallel.ep_size} "
            "tp x pp x ep); give it more memory (--kv-cache-memory) or lower --max-model-len")
    return num_blocks
