"""The roofline PNG: arithmetic intensity (FLOPs per byte) against achieved FLOP/s, with the
device's compute ceiling and memory slope, one marker per (profiled step, op class): colour by
op class, shape by step kind. Communication and host time do no arithmetic and are left off
(the CSV has them)."""
from __future__ import annotations

from pathlib import Path

from shardserve.profiler.report import ProfileRow
from shardserve.profiler.roofline import ROOFLINE_CLASSES

_COLORS = {"gemm": "tab:blue", "attention": "tab:orange", "elementwise": "tab:green", "sampling": "tab:purple"}
_MARKERS = {"prefill": "o", "decode": "s", "mixed": "^"}


def write_roofline_plot(rows: list[ProfileRow], peak_flop_s: float, bandwidth_bytes_s: float,
                        path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = []
    for row in rows:
        for cls in ROOFLINE_CLASSES:
            work, seconds = row.work[cls], row.measurement.class_s[cls]
            if work.flops <= 0 or work.bytes <= 0 or seconds <= 0:
                continue
            points.append((work.intensity, work.flops / seconds, cls, row.kind))
    intensities = [p[0] for p in points] or [1.0]
    low, high = min(intensities + [0.1]) / 2, max(intensities + [peak_flop_s / bandwidth_bytes_s]) * 2
    ridge = peak_flop_s / bandwidth_bytes_s
    xs = [low, ridge, high]
    ax.plot(xs, [min(peak_flop_s, x * bandwidth_bytes_s) for x in xs], color="black", linewidth=1.5)
    ax.annotate(f"peak {peak_flop_s / 1e9:.0f} GFLOP/s", (high, peak_flop_s), ha="right", va="bottom")
    ax.annotate(f"{bandwidth_bytes_s / 1e9:.0f} GB/s", (low * 1.3, low * 1.3 * bandwidth_bytes_s), rotation=30,
                va="bottom")
    seen = set()
    for intensity, flop_s, cls, kind in points:
        label = f"{cls} ({kind})"
        ax.scatter(intensity, flop_s, color=_COLORS[cls], marker=_MARKERS.get(kind, "o"), alpha=0.75,
                   label=None if label in seen else label)
        seen.add(label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if seen:
        ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
