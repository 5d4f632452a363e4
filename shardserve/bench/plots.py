"""PNG plots of benchmark results: latency CDFs of one run, and throughput / latency against
offered load when several load levels were run.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas directly, never
through pyplot: no global backend switch, no figure registry that leaks between calls.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shardserve.bench.stats import BenchResult, LatencySummary

_DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI)
    return path


def _cdf_axis(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.grid(True, alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post")
    for q, style in ((0.5, ":"), (0.99, "--")):
        ax.axvline(float(np.quantile(xs, q)), color="gray", linestyle=style, linewidth=0.8,
                   label=f"p{int(q * 100)} {np.quantile(xs, q):.1f}")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right", fontsize=8)


def plot_latency_cdfs(result: BenchResult, path: str | Path) -> Path:
    """One PNG with the CDFs of TTFT, TPOT and E2E latency over the run's successful requests."""
    ok = [r for r in result.records if r.ok]
    series = {
        "TTFT": [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s * 1000.0 for r in ok if r.tpot_s is not None],
        "E2E": [r.e2e_s * 1000.0 for r in ok],
    }
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, 3)
    for ax, (name, values_ms) in zip(axes, series.items()):
        _cdf_axis(ax, values_ms, name)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(f"{result.level.label}: {result.num_ok} ok, {result.num_failed} failed")
    fig.tight_layout()
    return _save(fig, Path(path))


def _offered_load(results: Sequence[BenchResult]) -> tuple[list[float], str]:
    """The x axis of a sweep: request rate when the levels differ in rate, else concurrency."""
    rates = [r.level.request_rate_qps for r in results]
    if all(rate is not None for rate in rates):
        return [float(rate) for rate in rates], "offered load (requests/s)"
    return [float(r.level.concurrency or 0) for r in results], "concurrency"


def plot_load_sweep(results: Sequence[BenchResult], path: str | Path) -> Path:
    """One PNG: output and request throughput against offered load, and p50 / p99 of TTFT, TPOT and
    E2E against offered load. Results are plotted in the order of their offered load."""
    xs, x_label = _offered_load(results)
    order = np.argsort(xs)
    xs = [xs[i] for i in order]
    ordered = [results[i] for i in order]
    fig = Figure(figsize=(13, 7))
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    ax.plot(xs, [r.output_throughput_tok_s for r in ordered], marker="o", label="output tok/s")
    ax.set_ylabel("output tokens/s")
    twin = ax.twinx()
    twin.plot(xs, [r.request_throughput_qps for r in ordered], marker="s", color="tab:orange", label="req/s")
    if ordered[0].goodput_qps is not None:
        twin.plot(xs, [r.goodput_qps for r in ordered], marker="^", color="tab:green", label="goodput req/s")
    twin.set_ylabel("requests/s")
    ax.set_title("throughput")
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax.legend(handles + twin_handles, labels + twin_labels, loc="upper left", fontsize=8)
    for ax, name in ((axes[0][1], "ttft"), (axes[1][0], "tpot"), (axes[1][1], "e2e")):
        summaries: list[LatencySummary] = [getattr(r, name) for r in ordered]
        ax.plot(xs, [s.p50_ms for s in summaries], marker="o", label="p50")
        ax.plot(xs, [s.p99_ms for s in summaries], marker="o", linestyle="--", label="p99")
        ax.set_title(f"{name.upper()} latency")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    wide = min(xs) > 0 and max(xs) / min(xs) >= 8  # e.g. concurrency 1..64: log axis keeps low levels apart
    for ax in (a for row in axes for a in row):
        if wide:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(x_label)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return _save(fig, Path(path))


def write_plots(results: Sequence[BenchResult], plot_dir: str | Path) -> list[Path]:
    """Write `cdf_<level>.png` per result and, with two or more results, `load_sweep.png`."""
    plot_dir = Path(plot_dir)
    paths = [plot_latency_cdfs(r, plot_dir / f"cdf_{_slug(r.level.label)}.png") for r in results]
    if len(results) >= 2:
        paths.append(plot_load_sweep(results, plot_dir / "load_sweep.png"))
    return paths


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", label).strip("_")
