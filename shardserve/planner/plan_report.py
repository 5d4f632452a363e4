"""What `shardserve plan` prints and writes: the ranked table, the JSON document, the Pareto plot,
and the fleet allocation table."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from shardserve.planner.fleet import FleetPlan
from shardserve.planner.search import Plan, PlanRow

_COLUMNS = ("#", "hardware", "layout", "replicas", "GPUs", "max batch", "TTFT ms", "p99", "TPOT ms", "p99",
            "$/1M tok", "fits", "SLO", "note")


def _number(value: float, digits: int = 1) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.{digits}f}"


def _cells(rank: int, row: PlanRow) -> tuple[str, ...]:
    fitted = row.fits
    return (str(rank), row.hardware, row.layout, str(row.replicas) if fitted else "-",
            str(row.total_gpus) if fitted else "-", str(row.max_num_seqs) if fitted else "-",
            _number(row.ttft_ms), _number(row.ttft_p99_ms), _number(row.tpot_ms), _number(row.tpot_p99_ms),
            _number(row.cost_per_million_tokens, 2),
            "yes" if row.fits else "no", "yes" if row.meets_slo else "no",
            row.note + ("-bound" if row.note in ("memory", "compute", "network", "overhead") else ""))


def format_table(rows: list[PlanRow] | tuple[PlanRow, ...], top: int) -> str:
    """The first `top` rows as an aligned text table (rank 1 = best)."""
    lines = [_COLUMNS] + [_cells(i + 1, row) for i, row in enumerate(rows[:top])]
    widths = [max(len(line[c]) for line in lines) for c in range(len(_COLUMNS))]
    left = {"hardware", "layout", "note"}
    out = []
    for line in lines:
        out.append("  ".join(cell.ljust(w) if name in left else cell.rjust(w)
                             for cell, w, name in zip(line, widths, _COLUMNS)).rstrip())
    return "\n".join(out)


def format_plan(plan: Plan, top: int, elapsed_s: float) -> str:
    """The table, how many layouts are feasible, and the cheap end of the Pareto front."""
    num_feasible = sum(r.feasible for r in plan.rows)
    lines = [format_table(plan.rows, top),
             f"{num_feasible} of {len(plan.rows)} layouts fit and meet the SLO; searched in {elapsed_s:.2f} s"]
    if plan.skipped:
        lines.append(f"not planned: {', '.join(plan.skipped)}")
    if not plan.best:
        lines.append("no deployment meets the SLO: relax it, allow more GPUs, or try other hardware")
    elif plan.pareto:
        front = ", ".join(f"{r.hardware} {r.layout} x{r.replicas} (${r.cost_per_million_tokens:.2f}, "
                          f"{r.e2e_ms / 1e3:.2f} s)" for r in plan.pareto[:6])
        lines.append(f"Pareto front ($/1M tok, mean E2E): {front}")
    return "\n".join(lines)


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _row_json(row: PlanRow) -> dict:
    data = {k: _finite_or_none(v) for k, v in dataclasses.asdict(row).items()}
    return {**data, "total_gpus": row.total_gpus, "feasible": row.feasible}


def plan_json(plan: Plan, meta: dict) -> dict:
    """`meta` (model, workload, slo, dtype, efficiency labels ...) plus ranked rows and the front."""
    return {**meta, "rows": [_row_json(r) for r in plan.rows], "pareto": [_row_json(r) for r in plan.pareto]}


def write_json(document: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def write_pareto_plot(plan: Plan, path: str | Path, title: str) -> None:
    """Scatter of every feasible point (cost per million output tokens vs mean E2E latency), one
    colour per device, with the Pareto front drawn through."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for hardware in sorted({p.hardware for p in plan.points}):
        mine = [p for p in plan.points if p.hardware == hardware]
        ax.scatter([p.e2e_ms / 1e3 for p in mine], [p.cost_per_million_tokens for p in mine], s=14, alpha=0.6,
                   label=hardware)
    if plan.pareto:
        ax.plot([p.e2e_ms / 1e3 for p in plan.pareto], [p.cost_per_million_tokens for p in plan.pareto],
                color="black", drawstyle="steps-post", linewidth=1, label="Pareto front")
        for p in plan.pareto[:8]:  # the cheap end; the rest are more replicas of the same layouts
            ax.annotate(f"{p.hardware} {p.layout} x{p.replicas}", (p.e2e_ms / 1e3, p.cost_per_million_tokens),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("mean end-to-end latency (s)")
    ax.set_yscale("log")  # costs span orders of magnitude (many replicas of deep pipelines)
    ax.set_ylabel("$ per 1M output tokens")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_fleet(plan: FleetPlan) -> str:
    """The allocation table, the hourly cost and the devices used, or why there is none."""
    if not plan.feasible:
        return f"no allocation: {plan.message}"
    header = ("model", "hardware", "layout", "replicas", "GPUs", "req/s per replica", "TTFT ms", "TPOT ms", "$/h")
    lines = [header]
    for a in plan.assignments:
        pred = a.prediction()  # latency at the traffic it is given, not at its capacity
        ttft, tpot = (pred.ttft_s * 1e3, pred.tpot_s * 1e3) if pred is not None else (math.nan, math.nan)
        lines.append((a.demand, a.option.hardware, a.option.layout, str(a.replicas), str(a.gpus),
                      _number(a.option.capacity_qps, 2), _number(ttft), _number(tpot),
                      _number(a.replicas * a.option.price_per_replica_hour, 2)))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    table = "\n".join("  ".join(cell.ljust(w) if c < 3 else cell.rjust(w)
                                for c, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)
    used = ", ".join(f"{name} {n_used}/{n_pool}" for name, n_used, n_pool in plan.gpus_used)
    return f"{table}\ntotal: ${plan.cost_per_hour_usd:,.2f}/h; devices used: {used}"
