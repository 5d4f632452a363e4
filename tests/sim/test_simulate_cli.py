"""`shardserve simulate`: a small run as a subprocess prints bench's report; bad input is one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardserve.cli import main
from shardserve.planner.efficiency import CALIBRATION_FORMAT

BASE = ["--model", "llama-3.1-8b", "--hardware", "H100", "--num-requests", "40", "--input-len", "200",
        "--range-ratio", "0.5", "--output-len", "32"]


def test_simulate_prints_the_bench_report_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "shardserve.cli", "simulate", *BASE, "--request-rate", "5,40",
                           "--slo", "ttft_ms=100", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "simulate: 1 x H100 SXM tp1 pp1 ep1, bfloat16, no router" in text and "uncalibrated" in text
    assert "=== rate=5 qps: 40 requests in" in text and "=== rate=40 qps: 40 requests in" in text
    for row in ("requests      ok 40   failed 0", "goodput", "  ms          mean       p50", "  TTFT", "  TPOT",
                "  ITL", "  E2E", "=== summary (latencies in ms) ==="):
        assert row in text
    results = json.loads(out.read_text())["results"]
    assert [r["level"]["request_rate_qps"] for r in results] == [5.0, 40.0]
    assert len(results[0]["records"]) == 40 and all(r["ttft_s"] > 0 for r in results[0]["records"])
    assert sum(r["num_output_tokens"] for r in results[0]["records"]) == results[0]["total_output_tokens"]


def test_fleet_closed_loop_and_calibration(tmp_path, capsys):
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"format": CALIBRATION_FORMAT, "source": "test",
                                       "devices": {"H100 SXM": {"gemm": 0.5, "memory": 0.6}}}))
    code = main(["simulate", *BASE, "--replicas", "3", "--policy", "round_robin", "--concurrency", "6",
                 "--calibration", str(calibration)])
    out = capsys.readouterr().out
    assert code == 0
    assert "3 x H100 SXM" in out and "router (round_robin)" in out and "calibrated (test" in out
    assert "=== concurrency=6: 40 requests in" in out and "uncalibrated" not in out


@pytest.mark.parametrize("argv,message", [
    (["--policy", "fastest"], "unknown routing policy 'fastest'"),
    (["--hardware", "H900"], "unknown hardware 'H900'"),
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--tp", "3"], "tp=3 does not divide"),
    (["--kv-cache-memory", "1000"], "less than one full context"),
    (["--dataset", "jsonl:/nonexistent.jsonl"], "cannot read trace"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["simulate", *BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
