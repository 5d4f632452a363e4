"""The load client against a real HTTP server in this process: a small FastAPI app that streams a
known number of SSE chunks with known delays, so counts and timing bounds are known.

The fake backend is steered per request through extra body fields (`fake_*`), which the client
forwards untouched via `extra_body`, exactly as it forwards `cache_prompt` to llama.cpp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shardserve.bench.cli_args import add_bench_parser, run_bench_command
from shardserve.bench.client import BenchClientError, run_benchmark_sync
from shardserve.bench.plots import write_plots
from shardserve.config import ConfigError
from shardserve.sim.workload import RequestSpec, WorkloadConfig, build_workload

MODEL = "fake-model"


class FakeBackend:
    """What the fake server saw: request bodies and the peak number of requests in flight."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0


def build_fake_app(seen: FakeBackend) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.bodies.append(body)
        reject_every = body.get("fake_reject_every")
        if body.get("fake_status") or (reject_every and len(seen.bodies) % reject_every == 0):
            status = body.get("fake_status") or 429
            return JSONResponse({"error": {"message": "server is at capacity", "code": status}}, status_code=status)
        return StreamingResponse(_events(body, seen), media_type="text/event-stream")

    return app


async def _events(body: dict, seen: FakeBackend):
    seen.in_flight += 1
    seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
    try:
        await asyncio.sleep(body.get("fake_ttft_s", 0.0))
        for i in range(body["max_tokens"]):
            if i == body.get("fake_error_after"):
                yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 503}})}\n\n"
                return
            if i:
                await asyncio.sleep(body.get("fake_itl_s", 0.0))
            text = body.get("fake_text", "t{i}").format(i=i)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': None}]}, ensure_ascii=False)}\n\n"
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
        if body.get("fake_usage", True) and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"], "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        seen.in_flight -= 1


@pytest.fixture()
def fake_server():
    """(base_url, FakeBackend) of a uvicorn server on a free port, in a background thread."""
    seen = FakeBackend()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; handing uvicorn the bound socket avoids a race
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_fake_app(seen), log_level="error", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def specs(num: int, output_len: int, arrivals_s: list[float] | None = None) -> list[RequestSpec]:
    arrivals_s = arrivals_s or [0.0] * num
    return [RequestSpec((100 + i, 200 + i), None, output_len, t) for i, t in zip(range(num), arrivals_s)]


def test_closed_loop_counts_timing_and_request_body(fake_server):
    base_url, seen = fake_server
    ttft_s, itl_s = 0.05, 0.02
    before_s = time.perf_counter()
    result = run_benchmark_sync(base_url, specs(4, 5), concurrency=2, show_progress=False,
                                extra_body={"fake_ttft_s": ttft_s, "fake_itl_s": itl_s})
    run_s = time.perf_counter() - before_s
    assert (result.num_ok, result.num_failed, result.total_output_tokens) == (4, 0, 20)
    for r in result.records:
        assert len(r.chunk_times_s) == 5 and r.num_output_tokens == 5 and r.tokens_from_usage
        assert list(r.chunk_times_s) == sorted(r.chunk_times_s)
        assert r.ttft_s >= ttft_s * 0.9  # the server cannot answer before its sleep
        assert sum(r.itls_s) >= 4 * itl_s * 0.9 and len(r.itls_s) == 4
        # offsets from the run's start (which falls inside this test's own reading of the clock)
        assert 0 <= r.start_s < r.chunk_times_s[0] <= r.end_s <= run_s
    assert result.itl.count == 16 and result.ttft.count == 4 and result.tpot.count == 4
    assert result.ttft.p50_ms >= ttft_s * 1000 * 0.9
    assert seen.max_in_flight == 2  # the closed loop keeps both clients busy, never a third
    body = seen.bodies[0]
    assert body["model"] == MODEL and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 5
    assert sorted(b["prompt"][0] for b in seen.bodies) == [100, 101, 102, 103]


def test_open_loop_sends_at_arrival_times(fake_server):
    base_url, seen = fake_server
    arrivals_s = [0.0, 0.15, 0.3]
    result = run_benchmark_sync(base_url, specs(3, 2, arrivals_s), show_progress=False, model="explicit",
                                ignore_eos=False, temperature=0.7, extra_body={"fake_ttft_s": 1.0})
    assert result.num_ok == 3
    assert seen.max_in_flight == 3  # each sent at its time, not after the one before has answered
    for r, t in zip(result.records, arrivals_s):
        assert r.scheduled_s == t and r.start_s >= t
    starts = [r.start_s for r in result.records]
    assert starts == sorted(starts) and starts[2] - starts[0] >= 0.25
    assert {b["model"] for b in seen.bodies} == {"explicit"}
    assert seen.bodies[0]["ignore_eos"] is False and seen.bodies[0]["temperature"] == 0.7


def test_rate_limited_requests_are_counted_apart(fake_server):
    base_url, _ = fake_server
    result = run_benchmark_sync(base_url, specs(4, 3), concurrency=1, show_progress=False,
                                extra_body={"fake_reject_every": 2})
    assert (result.num_ok, result.num_failed, result.num_rate_limited) == (2, 2, 2)
    failed = [r for r in result.records if not r.ok]
    assert all(r.status_code == 429 and "at capacity" in r.error for r in failed)
    assert result.total_output_tokens == 6
    assert result.error_samples == ("2x HTTP 429: server is at capacity",)


def test_other_failures_missing_usage_and_timeout(fake_server):
    base_url, _ = fake_server
    no_usage = run_benchmark_sync(base_url, specs(1, 3), show_progress=False, extra_body={"fake_usage": False})
    assert no_usage.records[0].num_output_tokens == 3 and not no_usage.records[0].tokens_from_usage
    broken = run_benchmark_sync(base_url, specs(1, 5), show_progress=False, extra_body={"fake_error_after": 2})
    r = broken.records[0]
    assert not r.ok and "engine died" in r.error and r.status_code == 200 and len(r.chunk_times_s) == 2
    slow = run_benchmark_sync(base_url, specs(1, 2), show_progress=False, timeout_s=0.2,
                              extra_body={"fake_ttft_s": 3.0})
    r = slow.records[0]
    # cut off at the timeout, not after the reply: the reply's first token (at 3 s) never came
    assert "timed out" in r.error and r.chunk_times_s == () and slow.num_rate_limited == 0
    bad = run_benchmark_sync(base_url, specs(1, 2), show_progress=False, extra_body={"fake_status": 400})
    assert bad.records[0].status_code == 400 and bad.num_rate_limited == 0


def test_unreachable_server_is_a_one_line_config_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(BenchClientError, match="cannot list models"):
            run_benchmark_sync(f"http://127.0.0.1:{port}", specs(1, 1), show_progress=False, timeout_s=2)


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_cli_runs_levels_and_writes_json_and_plots(fake_server, tmp_path, capsys):
    base_url, seen = fake_server
    args = parse_bench_args([
        "--base-url", base_url + "/v1/", "--num-requests", "3", "--concurrency", "1,2", "--input-len", "4",
        "--output-len", "3", "--slo", "ttft_ms=5000,tpot_ms=5000", "--result-json", str(tmp_path / "r.json"),
        "--plot-dir", str(tmp_path / "plots"), "--extra-body", '{"fake_itl_s": 0.005}', "--no-progress",
    ])
    assert args.func is run_bench_command
    assert run_bench_command(args) == 0
    out = capsys.readouterr().out
    assert "=== concurrency=1: 3 requests" in out and "=== summary" in out and "goodput" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["level"]["label"] for r in data["results"]] == ["concurrency=1", "concurrency=2"]
    assert all(r["num_ok"] == 3 and len(r["records"]) == 3 for r in data["results"])
    assert data["config"]["concurrency"] == "1,2"
    prompts = [tuple(b["prompt"]) for b in seen.bodies]
    assert len(prompts) == 6 and len(set(prompts)) == 6  # no level reuses another's prompts
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["cdf_concurrency_1.png", "cdf_concurrency_2.png", "load_sweep.png"]
    for name in pngs:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_for_rate_sweep_with_failures(fake_server, tmp_path):
    base_url, _ = fake_server
    workload = WorkloadConfig(num_requests=2, input_len=2, output_len=1, request_rate_qps=50.0)
    results = [run_benchmark_sync(base_url, build_workload(workload), show_progress=False,
                                  extra_body={"fake_status": 429} if i else {}) for i in range(2)]
    paths = write_plots(results, tmp_path)
    assert len(paths) == 3 and all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "a,b"], "--concurrency"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "trace"], "jsonl"),
    (["--slo", "ttft=1"], "--slo"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--extra-body", "{bad"], "--extra-body"),
    (["--num-requests", "0"], "--num-requests"),
    (["--dataset", "jsonl:/does/not/exist.jsonl"], "cannot read"),
    (["--dataset", "alpaca"], "unknown dataset"),
    (["--concurrency", "2", "--max-concurrency", "2"], "--max-concurrency"),
])
def test_cli_bad_flags_raise_config_error(argv, message):
    args = parse_bench_args(["--base-url", "http://127.0.0.1:9", *argv])
    with pytest.raises(ConfigError, match=message):
        run_bench_command(args)


def test_stream_lines_end_at_line_feeds_only(fake_server):
    """JSON may carry U+2028, U+2029 and U+0085 raw inside a string (a model's text): they do not
    end an SSE line, so every event still parses."""
    base_url, _ = fake_server
    result = run_benchmark_sync(base_url, specs(2, 4), concurrency=2, show_progress=False,
                                extra_body={"fake_text": "a\u2028b\x85c\u2029{i}"})
    assert (result.num_ok, result.num_failed, result.total_output_tokens) == (2, 0, 8)
    assert all(len(r.chunk_times_s) == 4 for r in result.records)
