"""The cluster file (`shardserve cluster --config cluster.yaml`), read into frozen dataclasses.

    router:                      # any RouterConfig field but `replicas`
      port: 8080
      policy: least_outstanding
    supervisor:                  # SupervisorConfig fields, all optional
      restart_backoff_s: 1.0
    groups:                      # replicas that share a model and a layout
      - name: llama
        model: /models/llama-3.2-1b
        tp: 2                    # pp, ep: default 1
        replicas: 2
        dtype: bfloat16
        serve_args: [--max-num-seqs, "64"]
        autoscale:               # optional; without it the group keeps `replicas`
          min_replicas: 1
          max_replicas: 4

Every mistake is a ConfigError of one line that names the key, e.g.
`cluster.yaml: groups[0].autoscale.max_replicas: must be at least min_replicas (2)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardserve.config import ConfigError, ParallelConfig, RouterConfig
from shardserve.dtypes import ENGINE_DTYPES


@dataclass(frozen=True)
class Layout:
    """How one replica is split: tp x pp (x ep for MoE) ranks; see ParallelConfig."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def parallel(self) -> ParallelConfig:
        """The engine's view of this layout: it owns the rank arithmetic."""
        return ParallelConfig(tp_size=self.tp, pp_size=self.pp, ep_size=self.ep)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "world_size": self.world_size}

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep}"


@dataclass(frozen=True)
class AutoscaleConfig:
    """When a group grows or shrinks (autoscaler.py). Two bands give hysteresis: above the high
    marks it grows, below the low marks (held for `scale_down_stable_s`) it shrinks, in between
    it holds; no change follows another within `cooldown_s`."""

    min_replicas: int = 1
    max_replicas: int = 1
    scale_up_waiting_per_replica: float = 4.0  # engine queue (vllm:num_requests_waiting) per replica
    scale_down_waiting_per_replica: float = 0.5
    kv_usage_high: float = 0.85  # mean vllm:kv_cache_usage_perc, 0..1
    kv_usage_low: float = 0.5
    cooldown_s: float = 30.0
    scale_down_stable_s: float = 120.0


@dataclass(frozen=True)
class ReplicaGroup:
    """`replicas` copies of one `shardserve serve` command: a model in one layout."""

    name: str
    model: str
    layout: Layout = field(default_factory=Layout)
    replicas: int = 1
    dtype: str = "float32"
    serve_args: tuple[str, ...] = ()  # more `shardserve serve` flags, e.g. ("--max-num-seqs", "64")
    autoscale: AutoscaleConfig | None = None


@dataclass(frozen=True)
class SupervisorConfig:
    """How the supervisor runs replica processes (supervisor.py)."""

    check_interval_s: float = 0.5
    startup_timeout_s: float = 300.0  # to a healthy /health; longer counts as a crash
    restart_backoff_s: float = 1.0  # the first restart's delay; doubles per consecutive crash
    restart_backoff_max_s: float = 60.0
    crash_forget_s: float = 60.0  # serving this long resets the consecutive-crash count
    unhealthy_restart_s: float = 30.0  # alive but failing the router's health checks this long: restart
    drain_timeout_s: float = 120.0  # a draining replica still busy then is stopped (its streams resume elsewhere)
    stop_timeout_s: float = 15.0  # SIGTERM, then SIGKILL after this long
    # GPU ids to hand out, world_size each, through CUDA_VISIBLE_DEVICES; empty: not managed (CPU)
    devices: tuple[int, ...] = ()
    log_dir: str | None = None  # replica logs; default: a fresh temporary folder


@dataclass(frozen=True)
class ClusterConfig:
    router: RouterConfig
    groups: tuple[ReplicaGroup, ...]
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def group(self, name: str) -> ReplicaGroup:
        return next(g for g in self.groups if g.name == name)


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; relative model paths are taken from the file's folder."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from None
    return cluster_config_from_dict(data, source=path.name, base_dir=path.parent)


def cluster_config_from_dict(data: Any, source: str = "cluster", base_dir: Path | None = None) -> ClusterConfig:
    data = _mapping(data, source)
    _no_unknown(data, {"router", "supervisor", "groups"}, source)
    router = _build(RouterConfig, _mapping(data.get("router") or {}, f"{source}: router"), f"{source}: router",
                    skip={"replicas"})
    supervisor = _build(SupervisorConfig, _mapping(data.get("supervisor") or {}, f"{source}: supervisor"),
                        f"{source}: supervisor")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise ConfigError(f"{source}: groups: give a list of at least one replica group")
    built = tuple(_group(g, f"{source}: groups[{i}]", base_dir) for i, g in enumerate(groups))
    names = [g.name for g in built]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: groups: names must differ, got {names}")
    return ClusterConfig(router=router, groups=built, supervisor=supervisor)


def _group(data: Any, where: str, base_dir: Path | None) -> ReplicaGroup:
    data = dict(_mapping(data, where))
    _no_unknown(data, {"name", "model", "tp", "pp", "ep", "replicas", "dtype", "serve_args", "autoscale"}, where)
    for key in ("name", "model"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{where}.{key}: required, a string")
    layout = _build(Layout, {k: data.pop(k) for k in ("tp", "pp", "ep") if k in data}, where)
    for key in ("tp", "pp", "ep"):
        if getattr(layout, key) < 1:
            raise ConfigError(f"{where}.{key}: must be at least 1")
    autoscale = data.pop("autoscale", None)
    if autoscale is not None:
        autoscale = _autoscale(_mapping(autoscale, f"{where}.autoscale"), f"{where}.autoscale")
    serve_args = data.pop("serve_args", [])
    if not isinstance(serve_args, list):
        raise ConfigError(f"{where}.serve_args: a list of flags and values")
    model = data.pop("model")
    if base_dir is not None and not Path(model).is_absolute() and (base_dir / model).exists():
        model = str(base_dir / model)
    values = _values(ReplicaGroup, data, where, skip={"layout", "serve_args", "autoscale", "model"})
    group = ReplicaGroup(**values, model=model, layout=layout, autoscale=autoscale,
                         serve_args=tuple(str(a) for a in serve_args))
    if group.dtype not in ENGINE_DTYPES:
        raise ConfigError(f"{where}.dtype: one of {', '.join(ENGINE_DTYPES)}, got {group.dtype!r}")
    if group.replicas < 1:
        raise ConfigError(f"{where}.replicas: must be at least 1")
    if autoscale and not autoscale.min_replicas <= group.replicas <= autoscale.max_replicas:
        raise ConfigError(f"{where}.replicas: must be within autoscale's {autoscale.min_replicas}.."
                          f"{autoscale.max_replicas}")
    return group


def _autoscale(data: dict, where: str) -> AutoscaleConfig:
    config = _build(AutoscaleConfig, data, where)
    if config.min_replicas < 1:
        raise ConfigError(f"{where}.min_replicas: must be at least 1 (scaling to zero is not supported)")
    if config.max_replicas < config.min_replicas:
        raise ConfigError(f"{where}.max_replicas: must be at least min_replicas ({config.min_replicas})")
    if config.scale_down_waiting_per_replica >= config.scale_up_waiting_per_replica:
        raise ConfigError(f"{where}.scale_down_waiting_per_replica: must be below scale_up_waiting_per_replica "
                          f"({config.scale_up_waiting_per_replica}), or the group would flap")
    if not 0 <= config.kv_usage_low < config.kv_usage_high <= 1:
        raise ConfigError(f"{where}.kv_usage_low, kv_usage_high: need 0 <= low < high <= 1")
    return config


def _build(cls, data: dict, where: str, skip: frozenset[str] | set[str] = frozenset()):
    """`cls(**data)`, each value checked against the type of the field's default."""
    try:
        return cls(**_values(cls, data, where, skip))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _values(cls, data: dict, where: str, skip: frozenset[str] | set[str] = frozenset()) -> dict:
    """`data`, known to be fields of `cls` and each of its field's default's type."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    _no_unknown(data, set(fields), where)
    values = {}
    for key, value in data.items():
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        values[key] = _check_type(value, default, f"{where}.{key}")
    return values


def _check_type(value: Any, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, list)
        value = tuple(value) if ok else value
    else:  # str, or an optional str
        ok = isinstance(value, str) or (default is None and value is None)
    if not ok:
        expected = "a list" if isinstance(default, tuple) else type(default or "").__name__
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _no_unknown(data: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def check_layout(model: str, layout: Layout) -> None:
    """Raise ConfigError (one sentence) unless `layout` can split `model`. Reads the checkpoint's
    config and headers only, so a bad layout is refused before any process starts."""
    from shardserve.models.checkpoint import load_checkpoint

    layout.parallel.validate(load_checkpoint(model).config)
