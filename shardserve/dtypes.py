"""The dtypes shardserve knows: each name, its bytes per element, and whether the engine runs in
it. The one table: the engine's torch mapping (engine/model_loader.py), the cluster file's check,
every `--dtype` flag and the cost model's byte counts read it. Imports no torch: the planner and
the simulator run without it.

    name       bytes  engine
    float32    4      yes
    bfloat16   2      yes
    float16    2      yes (GPU only: the engine refuses it on CPU)
    float8     1      no: the planner prices it (weights and KV at one byte); no kernel takes it
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import ConfigError


@dataclass(frozen=True)
class DType:
    name: str
    num_bytes: int  # per element
    runs_in_engine: bool


_TABLE = (
    DType("float32", 4, True),
    DType("bfloat16", 2, True),
    DType("float16", 2, True),
    DType("float8", 1, False),
)
DTYPES = {d.name: d for d in _TABLE}
ALL_DTYPES = tuple(DTYPES)  # what the planner and simulator price
ENGINE_DTYPES = tuple(d.name for d in _TABLE if d.runs_in_engine)  # what a replica can load


def dtype_bytes_of(name: str) -> int:
    """Bytes per element of `name`; ConfigError (one line) for a name not in the table."""
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(ALL_DTYPES)}")
    return DTYPES[name].num_bytes
