"""The dtypes shardserve knows: each name, its bytes per element, and whether the engine runs in
it. The one table: the engine's torch mapping (engine/model_loader.py), the cluster file's check,
every `--dtype` flag and the cost model's byte counts read it. Imports no torch: the planner and
the simulator run without it.

    name       bytes   KV bytes  engine
    float32    4       4         yes
    bfloat16   2       2         yes
    float16    2       2         yes (GPU only: the engine refuses it on CPU)
    float8     1       1         no: the planner prices it; the engine's weights take it
                                 through --quantization fp8 (layers/quantization.py)
    float4     0.5625  1         no: NVFP4 weights (4 bits + an fp8 scale per 16 values); the KV
                                 cache stays fp8, as the NVFP4 serving recipes keep it
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import ConfigError


@dataclass(frozen=True)
class DType:
    name: str
    num_bytes: float  # per weight element
    kv_num_bytes: int  # per KV-cache element, serving in this dtype
    runs_in_engine: bool


_TABLE = (
    DType("float32", 4, 4, True),
    DType("bfloat16", 2, 2, True),
    DType("float16", 2, 2, True),
    DType("float8", 1, 1, False),
    DType("float4", 0.5625, 1, False),
)
DTYPES = {d.name: d for d in _TABLE}
ALL_DTYPES = tuple(DTYPES)  # what the planner and simulator price
ENGINE_DTYPES = tuple(d.name for d in _TABLE if d.runs_in_engine)  # what a replica can load


def _dtype(name: str) -> DType:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(ALL_DTYPES)}")
    return DTYPES[name]


def dtype_bytes_of(name: str) -> float:
    """Bytes per weight element of `name`; ConfigError (one line) for a name not in the table."""
    return _dtype(name).num_bytes


def kv_bytes_of(name: str) -> int:
    """Bytes per KV-cache element when serving in `name`."""
    return _dtype(name).kv_num_bytes
