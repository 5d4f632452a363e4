"""`shardserve profile --quick` end to end on a tiny model (a subprocess, as a user runs it), its
three files, and `shardserve plan --calibration` reading what it wrote."""
from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys

import pytest

from shardserve.cli import main
from shardserve.bench.stats import parse_slo
from shardserve.planner.cli_args import DEFAULT_SLO
from shardserve.planner.efficiency import CALIBRATION_FORMAT, Efficiency, load_calibration
from shardserve.planner.model_presets import resolve_model
from shardserve.planner.replica_model import Workload
from shardserve.planner.search import SearchSpace, search
from shardserve.profiler.report import CSV_COLUMNS
from shardserve.profiler.sweep import QUICK_SWEEP


@pytest.fixture(scope="module")
def profiled(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    cmd = [sys.executable, "-m", "shardserve.cli", "profile", str(tiny_checkpoints["llama"]), "--quick",
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiler_start" not in proc.stderr  # the profiler's per-step log lines stay quiet
    return out, proc.stdout


def test_quick_profile_writes_three_files(profiled):
    out, stdout = profiled
    assert {p.name for p in out.iterdir()} == {"profile.csv", "roofline.png", "calibration.json"}
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bottleneck prefill: " in stdout and "bottleneck decode: " in stdout
    assert "calibration fit: step-time MAPE" in stdout


def test_csv_has_one_row_per_step_and_the_documented_columns(profiled):
    out, _ = profiled
    with open(out / "profile.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    # one row per point of the quick sweep that fits the tiny model's 512 positions, in order
    points = QUICK_SWEEP.points(512)
    assert [(r["label"], int(r["num_seqs"]), int(r["num_tokens"])) for r in rows] == [
        (p.label, p.num_step_seqs, p.num_step_tokens) for p in points]
    assert {r["kind"] for r in rows} == {"prefill", "decode", "mixed"}
    hardware = json.loads((out / "calibration.json").read_text())["devices"]["this host"]["hardware"]
    peak_flop_s, bandwidth = hardware["peak_flop_s"]["float32"], hardware["memory_bandwidth_bytes_s"]
    for row in rows:  # utilizations: the step's counted work over its time at the recorded peaks
        total_s = float(row["total_s"])
        assert float(row["mfu"]) == pytest.approx(float(row["flops"]) / (total_s * peak_flop_s), rel=1e-3)
        assert float(row["mbu"]) == pytest.approx(float(row["bytes"]) / (total_s * bandwidth), rel=1e-3)
    for row in rows:
        parts = sum(float(row[f"{c}_s"]) for c in ("gemm", "attention", "elementwise", "comm", "sampling", "host"))
        assert parts == pytest.approx(float(row["total_s"]), rel=1e-6)
        assert float(row["total_min_s"]) <= float(row["total_s"]) <= float(row["total_max_s"])
        assert 0 < float(row["mfu"]) <= 1 and 0 < float(row["mbu"]) <= 1
        assert row["bottleneck"] in ("compute", "memory", "network", "host")
        assert float(row["predicted_s"]) > 0


def test_prefill_split_adds_up_to_the_csv_prefill_rows(profiled):
    out, stdout = profiled
    line = next(l for l in stdout.splitlines() if l.startswith("prefill split: "))
    shares = {m.group(1): int(m.group(2)) for m in re.finditer(r"(gemm|attention|other) (\d+)%", line)}
    with open(out / "profile.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "prefill"]
    total = sum(float(r["total_s"]) for r in rows)
    for cls in ("gemm", "attention"):
        assert shares[cls] == pytest.approx(100 * sum(float(r[f"{cls}_s"]) for r in rows) / total, abs=1)
    assert sum(shares.values()) == pytest.approx(100, abs=2)
    assert line.endswith("most time: " + max(shares, key=shares.get))


def test_calibration_file_is_current_and_complete(profiled):
    out, _ = profiled
    data = json.loads((out / "calibration.json").read_text())
    assert data["format"] == CALIBRATION_FORMAT
    entry = data["devices"]["this host"]
    assert entry["dtype"] == "float32" and entry["num_samples"] >= 8
    assert entry["hardware"]["peak_flop_s"]["float32"] > 0
    calibration = load_calibration(out / "calibration.json")
    eff = calibration.for_device("this host")
    assert eff.calibrated and eff.step_time_mape == pytest.approx(entry["step_time_mape"])


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # the plan's JSON writes null


def test_plan_reads_the_calibration(profiled, tiny_checkpoints, capsys, tmp_path):
    """The plan runs on the file's factors and peaks: its rows are those of a search with the
    calibrated Efficiency, not the priors."""
    out, _ = profiled
    plan_file = tmp_path / "plan.json"
    code = main(["plan", "--model", str(tiny_checkpoints["llama"]), "--hardware", "this host", "--dtype", "float32",
                 "--calibration", str(out / "calibration.json"), "--qps", "1", "--isl", "32", "--osl", "16",
                 "--json", str(plan_file)])
    text = capsys.readouterr().out
    assert code in (0, 1)  # whether a layout meets the default SLO depends on this host's speed
    assert "this host: calibrated (shardserve profile" in text
    assert "uncalibrated" not in text
    calibration = load_calibration(out / "calibration.json")
    host, eff = calibration.hardware_for("this host"), calibration.for_device("this host")
    model, workload, slo = resolve_model(str(tiny_checkpoints["llama"])), Workload(32, 16, 1.0), parse_slo(DEFAULT_SLO)

    def rows(efficiency):  # layout, replicas and the predicted latencies of each ranked row
        plan = search(model, [(host, efficiency)], workload, slo, "float32", SearchSpace())
        return [(r.tp, r.pp, r.ep, r.replicas, _json_number(r.ttft_ms), _json_number(r.tpot_ms)) for r in plan.rows]
    planned = [tuple(r[k] for k in ("tp", "pp", "ep", "replicas", "ttft_ms", "tpot_ms"))
               for r in json.loads(plan_file.read_text())["rows"]]
    assert planned == rows(eff)
    assert planned != rows(Efficiency())
