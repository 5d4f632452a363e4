"""`shardserve plan`: the acceptance runs (subprocess) and the command's inputs and outputs. How
long a plan takes is benchmarks/plan_speed.py's to measure: a time limit here would fail on a
loaded machine, so the tests pin what the time depends on, the layouts searched."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from shardserve.cli import main
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import get_hardware
from shardserve.planner.model_presets import preset
from shardserve.planner.search import candidate_layouts

SLO_ARG = "ttft_ms=2000,tpot_ms=100"


@pytest.mark.parametrize("model", ["llama-3.1-70b", "mixtral-8x7b"])
def test_acceptance_plan_on_h100_and_h200(model, tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shardserve.cli", "plan", "--model", model, "--hardware", "H100,H200",
         "--isl", "1024", "--osl", "256", "--qps", "10", "--slo", SLO_ARG, "--json", str(out)],
        capture_output=True, text=True, timeout=120)  # a bound on a hang, not a speed target
    assert proc.returncode == 0, proc.stderr
    # one ranked row per layout searched: every layout of at most two 8-GPU nodes, and no more
    num_layouts = [len(candidate_layouts(preset(model), get_hardware(name), 2)) for name in ("H100", "H200")]
    assert num_layouts == ([15, 15] if model == "llama-3.1-70b" else [56, 56])  # 16 of them dp-attention
    assert "uncalibrated" in proc.stdout and "$/1M tok" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["calibrated"] is False
    assert len(plan["rows"]) == sum(num_layouts)
    top = plan["rows"][:3]
    assert {r["hardware"] for r in plan["rows"]} == {"H100 SXM", "H200"}
    for row in top:  # the best entries fit and meet the SLO by the planner's own model
        assert row["fits"] and row["meets_slo"] and row["feasible"]
        assert row["ttft_ms"] <= 2000 and row["tpot_ms"] <= 100
        assert row["max_num_seqs"] <= row["kv_capacity_seqs"]
    costs = [r["cost_per_million_tokens"] for r in plan["rows"] if r["feasible"]]
    assert costs == sorted(costs)


@pytest.mark.parametrize("argv,message", [
    (["--hardware", "H900"], "unknown hardware 'H900'"),
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--slo", "ttft=5"], "--slo: bad term"),
    (["--what-if", "bandwidth=2x"], "bad what-if term"),
    (["--qps", "0"], "qps must be a positive"),
    (["--calibration", "/nonexistent.json"], "cannot read calibration file"),
    (["--isl", "200000"], "exceeds the model's context window of 131072"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    base = {"--model": "llama-3.1-8b", "--hardware": "H100", "--qps": "1"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    args = ["plan"] + [x for kv in base.items() for x in kv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_priors_a_plan_names_are_the_ones_it_runs_on(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "H100", "--qps", "1", "--top", "1"]) == 0
    prior = Efficiency()
    named = re.search(r"literature priors: gemm ([\d.]+), attention ([\d.]+), memory ([\d.]+), network ([\d.]+), "
                      r"overlap ([\d.]+), ([\d.]+) ms per step", capsys.readouterr().out)
    assert named is not None
    assert [float(v) for v in named.groups()] == [prior.gemm, prior.attention, prior.memory, prior.network,
                                                   prior.overlap, prior.step_overhead_s * 1e3]


def test_missing_qps_is_an_error(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "H100"]) == 2
    assert "--qps" in capsys.readouterr().err


def test_calibration_file_replaces_the_priors(tmp_path, capsys):
    calibration = tmp_path / "eff.json"
    calibration.write_text(json.dumps({
        "format": "shardserve-efficiency/1", "source": "unit test",
        "devices": {"h100": {"memory": 0.95, "step_overhead_s": 0.0005, "step_time_mape": 0.12}}}))
    out_cal, out_raw = tmp_path / "cal.json", tmp_path / "raw.json"
    common = ["plan", "--model", "llama-3.1-8b", "--hardware", "H100,H200", "--qps", "4"]
    assert main(common + ["--calibration", str(calibration), "--json", str(out_cal)]) == 0
    stdout = capsys.readouterr().out
    assert "H100 SXM: calibrated (unit test, fit error 12%)" in stdout and "H200: uncalibrated" in stdout
    assert main(common + ["--json", str(out_raw)]) == 0
    cal, raw = json.loads(out_cal.read_text()), json.loads(out_raw.read_text())

    def h100_tp1(plan):
        return next(r for r in plan["rows"] if r["hardware"] == "H100 SXM" and r["tp"] == 1 and r["pp"] == 1)
    assert h100_tp1(cal)["tpot_ms"] < h100_tp1(raw)["tpot_ms"]  # more bandwidth, less overhead per step


def test_what_if_prints_the_comparison_and_plot_is_written(tmp_path, capsys):
    png = tmp_path / "pareto.png"
    code = main(["plan", "--model", "llama-3.1-70b", "--hardware", "H100", "--qps", "20", "--osl", "512",
                 "--slo", "ttft_ms=2000,tpot_ms=50", "--what-if", "mem_bw=2x", "--plot", str(png)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "what-if mem_bw=2x: best" in stdout and "on today's devices" in stdout
    # the comparison shows the latency it buys, not only the cost: twice the bandwidth, lower TPOT
    new_tpot, old_tpot = (float(t) for t in re.findall(r"TPOT ([0-9.]+) ms", next(
        line for line in stdout.splitlines() if line.startswith("what-if "))))
    assert new_tpot < old_tpot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_feasible_plan_exits_1(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "H100", "--qps", "1", "--slo", "tpot_ms=0.5"]) == 1
    assert "no deployment meets the SLO" in capsys.readouterr().out


def test_fleet_mode(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pool: {H100: 4, H200: 2}\nmodels:\n  - {model: llama-3.1-8b, qps: 6}\n"
                     "  - {model: mixtral-8x7b, qps: 2}\n")
    out = tmp_path / "fleet.json"
    assert main(["plan", "--fleet", str(fleet), "--max-nodes-per-replica", "1", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "fleet: 2 models onto H100 SXM x4, H200 x2" in stdout and "total: $" in stdout
    assert "uncalibrated" in stdout
    result = json.loads(out.read_text())
    assert result["feasible"] and {a["model"] for a in result["assignments"]} == {"llama-3.1-8b", "mixtral-8x7b"}
