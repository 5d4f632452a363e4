"""The CLI as a user runs it: a real subprocess, one-line errors, no tracebacks."""
import os
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_generate_prints_coherent_text():
    proc = run_cli("generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-tokens", "8",
                   "--kv-cache-memory", str(64 << 20), "--max-model-len", "512")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris")


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("bad") / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        path.write_bytes(src.read(5_000_000))
    return path


@pytest.mark.parametrize("case, args, message", [
    ("empty prompt", ["--prompt", ""], "prompt is empty"),
    ("too long", ["--prompt", "word " * 200, "--max-model-len", "64"], "context window"),
    ("max tokens", ["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    ("top p", ["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    ("unknown model", ["--prompt", "hi", "--model", "/no/such/model"], "/no/such/model"),
])
def test_bad_input_gives_one_line_error(case, args, message, tiny_checkpoints):
    if "--model" not in args:
        args = args + ["--model", str(tiny_checkpoints["llama"]), "--kv-cache-memory", str(4 << 20)]
    proc = run_cli("generate", *args)
    assert proc.returncode == 2, case
    assert "Traceback" not in proc.stderr
    # the loading progress bar may precede it; the error itself is one line
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "loading" not in line]
    assert len(lines) == 1 and lines[0].startswith("shardserve: error:") and message in lines[0], proc.stderr


def test_truncated_gguf_gives_one_line_error(truncated_gguf):
    proc = run_cli("generate", "--model", str(truncated_gguf), "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cut.gguf" in proc.stderr and "truncated" in proc.stderr


@pytest.mark.parametrize("flags, device, budget, prefault", [
    ([], "cpu", 512, True),  # a CPU server prefills a wave of prompts a few at a time (config.serving_token_budget)
    (["--max-num-batched-tokens", "4096", "--no-prefault-kv-cache"], "cpu", 4096, False),
    ([], "cuda", 2048, False),
])
def test_serve_defaults_for_the_device(monkeypatch, flags, device, budget, prefault):
    import shardserve.server.serve
    from shardserve.cli import main

    seen = {}
    monkeypatch.setattr(shardserve.server.serve, "run_server", lambda config, server, auth: seen.setdefault("config", config) and 0)
    assert main(["serve", "--device", device, *flags]) == 0
    assert seen["config"].scheduler.max_num_batched_tokens == budget
    assert seen["config"].cache.prefault_kv_cache is prefault


def test_offline_engine_keeps_its_defaults():
    from shardserve.cli import build_parser
    from shardserve.engine.cli_args import engine_kwargs

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert engine_kwargs(args)["max_num_batched_tokens"] == 2048
    assert engine_kwargs(args)["prefault_kv_cache"] is False
