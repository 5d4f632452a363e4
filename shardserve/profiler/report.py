"""The profiler's outputs: the per-step CSV, the printed table, and the bottleneck lines.

CSV columns (one row per profiled step; seconds are the median unprofiled step's, split by the
profiled one, see step_measure.py):

    kind, label, num_seqs, num_tokens, context_len (mean tokens attended per sequence)
    gemm_s, attention_s, elementwise_s, comm_s, sampling_s, host_s   sum to total_s
    total_s, total_min_s, total_max_s                                over the timed repeats
    schedule_s, prepare_s, forward_s, sample_s, update_s, other_s    the step's phases (step_probe.py)
    comm_<collective>_s                                              comm_s by collective
    flops, bytes, mfu, mbu, bottleneck                               roofline.py
    predicted_s, fit_error                                           the calibrated cost model
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from shardserve.profiler.op_classes import OP_CLASSES
from shardserve.profiler.roofline import BOTTLENECKS, OpWork
from shardserve.profiler.step_measure import PointMeasurement
from shardserve.profiler.step_probe import PHASES

COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "broadcast", "p2p", "barrier", "other")
CSV_COLUMNS = (
    ("kind", "label", "num_seqs", "num_tokens", "context_len")
    + tuple(f"{cls}_s" for cls in OP_CLASSES)
    + ("total_s", "total_min_s", "total_max_s")
    + tuple(f"{phase}_s" for phase in PHASES)
    + tuple(f"comm_{name}_s" for name in COLLECTIVES)
    + ("flops", "bytes", "mfu", "mbu", "bottleneck", "predicted_s", "fit_error")
)


@dataclass
class ProfileRow:
    """One profiled step with its work, utilization and bottleneck, and the fitted prediction."""

    measurement: PointMeasurement
    work: dict[str, OpWork]
    mfu: float
    mbu: float
    shares: dict[str, float]  # seconds by bottleneck kind (roofline.bottleneck_shares)
    bottleneck: str
    predicted_s: float | None = None

    @property
    def kind(self) -> str:
        return self.measurement.point.kind

    @property
    def total_s(self) -> float:
        return self.measurement.timing.total_s


def csv_record(row: ProfileRow) -> dict[str, object]:
    m = row.measurement
    record: dict[str, object] = {
        "kind": row.kind, "label": m.point.label, "num_seqs": m.num_seqs, "num_tokens": m.num_tokens,
        "context_len": round(m.mean_context_len, 1),
        "total_s": m.timing.total_s, "total_min_s": min(m.totals_s), "total_max_s": max(m.totals_s),
        "flops": row.work["gemm"].flops + row.work["attention"].flops,
        "bytes": row.work["gemm"].bytes + row.work["attention"].bytes,
        "mfu": row.mfu, "mbu": row.mbu, "bottleneck": row.bottleneck,
        "predicted_s": row.predicted_s if row.predicted_s is not None else "",
        "fit_error": (row.predicted_s / m.timing.total_s - 1) if row.predicted_s is not None else "",
    }
    record.update({f"{cls}_s": m.class_s[cls] for cls in OP_CLASSES})
    record.update({f"{phase}_s": m.timing.phase_s.get(phase, 0.0) for phase in PHASES})
    record.update({f"comm_{name}_s": m.comm_s.get(name, 0.0) for name in COLLECTIVES})
    return record


def write_csv(rows: list[ProfileRow], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(csv_record(row))


def format_table(rows: list[ProfileRow]) -> str:
    """One line per step: time, op-class shares, MFU / MBU, bottleneck, fit error."""
    header = (f"{'step':<22} {'ms':>9} {'gemm':>5} {'attn':>5} {'elem':>5} {'comm':>5} {'samp':>5} {'host':>5}"
              f" {'MFU':>6} {'MBU':>6}  {'bound':<8} {'fit':>6}")
    lines = [header, "-" * len(header)]
    for row in rows:
        m = row.measurement
        shares = " ".join(f"{m.class_s[cls] / m.timing.total_s:5.0%}" for cls in OP_CLASSES)
        fit = f"{row.predicted_s / m.timing.total_s - 1:+6.0%}" if row.predicted_s is not None else ""
        lines.append(f"{m.point.label:<22} {m.timing.total_s * 1e3:9.2f} {shares} {row.mfu:6.1%} {row.mbu:6.1%}  "
                     f"{row.bottleneck:<8} {fit:>6}")
    return "\n".join(lines)


def bottleneck_line(kind: str, rows: list[ProfileRow]) -> str | None:
    """What bounds the `kind` steps overall (their seconds summed by bottleneck), with the shares,
    the MFU / MBU range, and per-step bottlenecks where they differ."""
    rows = [r for r in rows if r.kind == kind]
    if not rows:
        return None
    total = dict.fromkeys(BOTTLENECKS, 0.0)
    for row in rows:
        for name in BOTTLENECKS:
            total[name] += row.shares[name]
    whole = sum(total.values()) or 1.0
    name = max(BOTTLENECKS, key=total.__getitem__)
    shares = ", ".join(f"{b} {total[b] / whole:.0%}" for b in BOTTLENECKS)
    label = "host overhead" if name == "host" else name
    line = (f"{kind}: {label}-bound ({shares} of step time); MFU {min(r.mfu for r in rows):.1%}-"
            f"{max(r.mfu for r in rows):.1%}, MBU {min(r.mbu for r in rows):.1%}-{max(r.mbu for r in rows):.1%}")
    odd = [r for r in rows if r.bottleneck != name]
    if odd:
        line += "; " + ", ".join(f"{r.measurement.point.label} {r.bottleneck}-bound" for r in odd)
    return line


def prefill_split_line(rows: list[ProfileRow], peak_flop_s: float) -> str | None:
    """Where the prefill steps' time goes: GEMM, attention and everything else (seconds summed over
    the prefill points), each matmul class's FLOP/s against the peak, and the largest part named."""
    rows = [r for r in rows if r.kind == "prefill"]
    if not rows:
        return None
    seconds = {cls: sum(r.measurement.class_s[cls] for r in rows) for cls in ("gemm", "attention")}
    whole = sum(r.measurement.timing.total_s for r in rows)
    seconds["other"] = max(0.0, whole - seconds["gemm"] - seconds["attention"])
    parts = []
    for cls, s in seconds.items():
        part = f"{cls} {s / whole:.0%}"
        if cls != "other" and s > 0:
            rate = sum(r.work[cls].flops for r in rows) / s
            part += f" ({rate / 1e9:.1f} GFLOP/s, {rate / peak_flop_s:.0%} of peak)"
        parts.append(part)
    largest = max(seconds, key=seconds.__getitem__)
    return f"prefill split: {', '.join(parts)}; most time: {largest}"
