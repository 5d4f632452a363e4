"""Offline throughput: shardserve vs Hugging Face transformers `generate` and vLLM's `LLM.generate`.

What it measures
    Output tokens per second on two fixed-seed workloads of random token-id prompts (ids in
    [100, 40000), greedy, every request ignores EOS so output lengths are exact):
      uniform  64 requests, 128-token prompts, 128 output tokens each
      mixed    64 requests, prompt lengths uniform in 16..512, output lengths uniform in 16..256
    plus, for shardserve, the peak RSS against a memory limit and the decode efficiency: the
    measured decode-step time at batch 32 and 128 against a roofline bound built from this
    machine's measured matmul FLOP/s and copy bandwidth.

Method
    shardserve: `LLM("smollm2", dtype=..., quantization="none", kv_cache_memory_bytes=1 GiB, prefault_kv_cache=True)
                .generate(all prompts)`
    after a short warm-up; continuous batching decides the batches. Throughput = output tokens /
    wall time.
    HF: `model.generate` on padded static batches, as users run it: left padding with pad id =
    EOS (2), `do_sample=False`, `min_new_tokens = max_new_tokens` (so EOS cannot end a row
    early). A static batch runs until its longest request's output length; only each request's
    own output length counts as useful tokens, so the padding steps of short requests are
    wasted work, as in a real static-batch deployment. `uniform` tries batch sizes 1, 8 and 32
    and reports the best; batch 1 runs on the first 8 requests only and its tokens/s stands for
    the whole workload (each request costs the same there). `mixed` uses the best uniform batch
    size, with requests batched in arrival order. Every batch size gets a 4-token warm-up
    generate before its timed run.
    Decode efficiency: B requests with 128-token prompts are stepped until all are prefilled,
    3 steps warm up, then ~10 steps of exactly B decode tokens are timed (median step time).
    Bound = max(FLOPs / matmul FLOP/s, bytes / copy bandwidth) with FLOPs = 2 * B * linear
    params (lm_head included) + 4 * B * C * layers * heads * head_dim and bytes = weights +
    B * C * KV bytes per token, C the mean context of the timed steps; matmul FLOP/s is a
    2048^3 torch.mm in the run's dtype, bandwidth a float32 1 GiB copy (read + write), both
    medians. Efficiency = bound / measured step; the target is >= 50% at batch 32.
    Prefill efficiency: one 1,024-token random prompt alone in the engine, from add_request to
    its first token (median of 3 after a warm-up), as FLOP/s (every layer's linears on every
    token, the LM head on the last, causal QK^T and PV) over the same run's matmul FLOP/s
    (`prefill_efficiency_1024`; target >= 50%).
    vLLM: `LLM(folder, dtype, max_model_len=2048).generate` on the same prompts (token ids),
    greedy with ignore_eos, after a 4-token warm-up, in vLLM's own venv (benchmarks/
    vllm_reference.py; the folder holds the embedded GGUF's weights as safetensors), once per
    thread binding (`VLLM_CPU_OMP_THREADS_BIND` auto and 0-1); the faster on uniform counts.
    Ours runs first, vLLM right after it and transformers last: the ratio to vLLM is the one
    near its bar, and this host's speed drifts within minutes (with transformers' 6-7 minutes
    between them, ours and vLLM were measured on different hosts in effect).
    Each system runs in its own child process ("spawn" start method, results through a queue)
    so that `ru_maxrss` is that system's own peak RSS; the parent imports neither torch nor
    shardserve, because a spawned child inherits the parent's RSS high-water mark at fork time.

Run
    .venv/bin/python benchmarks/offline_throughput.py [--dtype float32] [--quick] [--skip-hf] [--skip-vllm]

    --quick runs a small version (8 requests, 32-token prompts and outputs, HF at batch 8 only,
    decode efficiency at batch 8, a 256 MiB bandwidth test) in under a minute. The table goes to
    stdout, phase progress to stderr; the last stdout line is `RESULT {json}`, and the same JSON
    plus details is written to benchmarks/results/offline_throughput_<dtype>[_quick].json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import queue
import random
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
KV_CACHE_BYTES = GIB
RSS_HEADROOM_BYTES = 400 * MIB  # allowance for the Python runtime, torch and activations
EOS_ID = 2
PROMPT_ID_RANGE = (100, 40000)
COMPARED_TOKENS = 16  # leading greedy tokens compared between the two systems
EFFICIENCY_TARGET = 0.5
EFFICIENCY_TARGET_BATCH = 32
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Settings:
    num_requests: int
    uniform_prompt_len: int
    uniform_output_len: int
    mixed_prompt_range: tuple[int, int]  # inclusive
    mixed_output_range: tuple[int, int]  # inclusive
    warmup_requests: int
    hf_batch_sizes: tuple[int, ...]
    hf_batch1_requests: int  # batch 1 runs on this many requests only; tokens/s extrapolates
    decode_batch_sizes: tuple[int, ...]
    decode_prompt_len: int
    decode_warmup_steps: int
    decode_timed_steps: int
    prefill_reps: int  # timed 1,024-token prefills (after one warm-up)
    matmul_n: int
    matmul_reps: int
    bandwidth_bytes: int
    bandwidth_reps: int


FULL = Settings(
    num_requests=64, uniform_prompt_len=128, uniform_output_len=128,
    mixed_prompt_range=(16, 512), mixed_output_range=(16, 256), warmup_requests=8,
    hf_batch_sizes=(1, 8, 32), hf_batch1_requests=8,
    decode_batch_sizes=(32, 128), decode_prompt_len=128, decode_warmup_steps=3, decode_timed_steps=10,
    prefill_reps=3, matmul_n=2048, matmul_reps=5, bandwidth_bytes=GIB, bandwidth_reps=5,
)
QUICK = Settings(
    num_requests=8, uniform_prompt_len=32, uniform_output_len=32,
    mixed_prompt_range=(16, 64), mixed_output_range=(8, 32), warmup_requests=4,
    hf_batch_sizes=(8,), hf_batch1_requests=8,
    decode_batch_sizes=(8,), decode_prompt_len=128, decode_warmup_steps=2, decode_timed_steps=5,
    prefill_reps=1, matmul_n=2048, matmul_reps=3, bandwidth_bytes=256 * MIB, bandwidth_reps=3,
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    warmup_prompts: list[list[int]]  # distinct ids, so the prefix cache gives the timed run nothing

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


def log(message: str) -> None:
    print(f"[offline_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(num_tokens)]


def build_workloads(s: Settings) -> dict[str, Workload]:
    rng = random.Random(0)
    uniform = Workload(
        "uniform",
        [random_prompt(rng, s.uniform_prompt_len) for _ in range(s.num_requests)],
        [s.uniform_output_len] * s.num_requests,
        [random_prompt(rng, s.uniform_prompt_len) for _ in range(s.warmup_requests)],
    )
    rng = random.Random(1)
    prompt_lens = [rng.randint(*s.mixed_prompt_range) for _ in range(s.num_requests)]
    mixed = Workload(
        "mixed",
        [random_prompt(rng, n) for n in prompt_lens],
        [rng.randint(*s.mixed_output_range) for _ in range(s.num_requests)],
        [random_prompt(rng, n) for n in prompt_lens[: s.warmup_requests]],
    )
    return {"uniform": uniform, "mixed": mixed}


# --- child processes ------------------------------------------------------------------------------
def _child_entry(fn, kwargs: dict, results: multiprocessing.Queue) -> None:
    try:
        results.put(("ok", fn(**kwargs)))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put(("error", traceback.format_exc()))


def run_in_child(fn, **kwargs) -> dict:
    """Run fn(**kwargs) in a fresh spawned process and return its result dict."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child_entry, args=(fn, kwargs, results), name=fn.__name__)
    proc.start()
    outcome = None
    while outcome is None:
        try:
            outcome = results.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                try:  # the result may have landed between the timeout and the liveness check
                    outcome = results.get(timeout=5.0)
                except queue.Empty:
                    raise RuntimeError(f"{fn.__name__} exited with code {proc.exitcode} and no result") from None
    proc.join()
    status, payload = outcome
    if status == "error":
        raise RuntimeError(f"{fn.__name__} failed in its child process:\n{payload}")
    return payload


# --- shardserve child -----------------------------------------------------------------------------
def shardserve_child(dtype: str, workloads: dict[str, Workload], settings: Settings) -> dict:
    from shardserve.llm import LLM

    log(f"shardserve: loading smollm2 ({dtype})")
    start_s = time.perf_counter()
    # the pool committed at start-up, as `serve` does and vLLM's zero-filled cache is: first writes
    # to a fresh pool otherwise pay page faults inside the timed steps
    llm = LLM("smollm2", dtype=dtype, quantization="none", kv_cache_memory_bytes=KV_CACHE_BYTES, prefault_kv_cache=True,
              show_progress=False)
    result = {"load_s": time.perf_counter() - start_s, "rss_after_load_mib": peak_rss_mib()}
    for name, workload in workloads.items():
        log(f"shardserve: {name} start ({len(workload.prompts)} requests)")
        result[name] = shardserve_workload(llm, workload)
        # Running peak so far: taken before the decode probes and the bandwidth buffers raise it.
        result[name]["peak_rss_mib"] = peak_rss_mib()
        log(f"shardserve: {name} done, {result[name]['tok_s']:.1f} tok/s")
    result["decode_efficiency"] = decode_efficiency(llm.engine, dtype, settings)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def shardserve_workload(llm, workload: Workload) -> dict:
    from shardserve.request import SamplingParams

    def params(max_tokens: int):
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    llm.generate(workload.warmup_prompts, [params(4) for _ in workload.warmup_prompts])
    start_s = time.perf_counter()
    outputs = llm.generate(workload.prompts, [params(n) for n in workload.output_lens])
    wall_s = time.perf_counter() - start_s
    got = [len(out.outputs[0].token_ids) for out in outputs]
    if got != workload.output_lens:
        raise RuntimeError(f"{workload.name}: shardserve produced {sum(got)} tokens, "
                           f"expected {workload.total_output_tokens}")
    return {
        "num_requests": len(outputs), "output_tokens": sum(got), "wall_s": wall_s, "tok_s": sum(got) / wall_s,
        "first_tokens": [out.outputs[0].token_ids[:COMPARED_TOKENS] for out in outputs],
    }


def decode_step_time(engine, batch_size: int, settings: Settings) -> dict:
    """Median wall time of an engine step made of exactly `batch_size` decode tokens."""
    from shardserve.request import SamplingParams

    rng = random.Random(1000 + batch_size)
    budget_tok = engine.config.scheduler.max_num_batched_tokens
    prefill_steps = -(-batch_size * settings.decode_prompt_len // budget_tok) + 1
    # Enough tokens that nobody finishes before the last timed step (early requests decode while
    # later ones are still prefilling).
    max_tokens = prefill_steps + settings.decode_warmup_steps + settings.decode_timed_steps + 8
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    reqs = [engine.add_request(f"decode-b{batch_size}-{i}", random_prompt(rng, settings.decode_prompt_len), params)
            for i in range(batch_size)]
    for _ in range(10 * prefill_steps):
        if all(r.output_token_ids for r in reqs):
            break
        engine.step()
    for _ in range(settings.decode_warmup_steps):
        engine.step()
    preemptions_before = engine.scheduler.num_preemptions
    # A decode at position p attends p + 1 tokens, i.e. the request's num_tokens at step start.
    context_start_tok = statistics.fmean(r.num_tokens for r in reqs)
    step_sizes, step_times_s = [], []
    for _ in range(settings.decode_timed_steps):
        start_s = time.perf_counter()
        step_sizes.append(len(engine.step()))
        step_times_s.append(time.perf_counter() - start_s)
    pure_decode = (step_sizes == [batch_size] * len(step_sizes) and engine.scheduler.num_waiting == 0
                   and engine.scheduler.num_preemptions == preemptions_before)
    for r in reqs:
        engine.abort_request(r.req_id)
    if not pure_decode:
        raise RuntimeError(f"decode probe at batch {batch_size} was not pure decode: step sizes {step_sizes}")
    avg_context_tok = context_start_tok + (settings.decode_timed_steps - 1) / 2
    # The median, not the mean: on a shared CPU one preempted step can cost 10x a normal one.
    return {"batch_size": batch_size, "step_s": statistics.median(step_times_s),
            "mean_step_s": statistics.fmean(step_times_s), "avg_context_tok": avg_context_tok}


def matmul_flop_s(dtype_name: str, n: int, reps: int) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # first call pays for thread-pool start-up and kernel selection
    times_s = []
    for _ in range(reps):
        start_s = time.perf_counter()
        torch.mm(a, b)
        times_s.append(time.perf_counter() - start_s)
    return 2 * n**3 / statistics.median(times_s)


def copy_bandwidth_bytes_s(num_bytes: int, reps: int) -> float:
    """Bytes read plus written per second by a float32 tensor copy."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page of dst, so page faults stay out of the timing
    times_s = []
    for _ in range(reps):
        start_s = time.perf_counter()
        dst.copy_(src)
        times_s.append(time.perf_counter() - start_s)
    return 2 * src.numel() * 4 / statistics.median(times_s)


def decode_bound(model_config, dtype_bytes: int, batch_size: int, context_tok: float,
                 flop_s: float, bandwidth_bytes_s: float) -> dict:
    """Roofline lower bound on one decode step: the slower of its matmul FLOPs and its bytes moved."""
    mc = model_config
    attn_params = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    mlp_params = 3 * mc.hidden_size * mc.intermediate_size
    # lm_head is a vocab x hidden matmul whether or not it shares storage with the embedding.
    linear_params = mc.num_layers * (attn_params + mlp_params) + mc.vocab_size * mc.hidden_size
    # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, per query head and context token.
    attn_flops = 4 * batch_size * context_tok * mc.num_layers * mc.num_heads * mc.head_dim
    flops = 2 * batch_size * linear_params + attn_flops
    weights_bytes = mc.num_params * dtype_bytes
    kv_read_bytes = batch_size * context_tok * mc.kv_bytes_per_token(dtype_bytes)
    compute_s = flops / flop_s
    memory_s = (weights_bytes + kv_read_bytes) / bandwidth_bytes_s
    return {"flops": flops, "bytes": weights_bytes + kv_read_bytes, "compute_bound_s": compute_s,
            "memory_bound_s": memory_s, "bound_s": max(compute_s, memory_s)}


PREFILL_TOKENS = 1024


def prefill_time(engine, num_tokens: int, reps: int) -> float:
    """Median wall time from adding one `num_tokens` prompt to its first token (alone in the engine)."""
    from shardserve.request import SamplingParams

    rng = random.Random(2000 + num_tokens)
    times_s = []
    for rep in range(reps + 1):  # the first run warms up this shape
        req = engine.add_request(f"prefill-{num_tokens}-{rep}", random_prompt(rng, num_tokens),
                                 SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        start_s = time.perf_counter()
        while not req.output_token_ids:
            engine.step()
        times_s.append(time.perf_counter() - start_s)
        engine.abort_request(req.req_id)
    return statistics.median(times_s[1:])


def prefill_flops(model_config, num_tokens: int) -> float:
    """Matmul FLOPs of one causal prefill: every layer's linears on every token, the LM head on the
    last one, and QK^T + PV over (i + 1) keys for token i."""
    mc = model_config
    attn_params = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    layer_params = attn_params + 3 * mc.hidden_size * mc.intermediate_size
    pairs = num_tokens * (num_tokens + 1) / 2
    return (2 * num_tokens * mc.num_layers * layer_params + 2 * mc.vocab_size * mc.hidden_size
            + 4 * pairs * mc.num_layers * mc.num_heads * mc.head_dim)


def decode_efficiency(engine, dtype: str, settings: Settings) -> dict:
    import torch

    log(f"shardserve: prefill timing at {PREFILL_TOKENS} tokens")
    prefill_s = prefill_time(engine, PREFILL_TOKENS, settings.prefill_reps)
    steps = {}
    for batch_size in settings.decode_batch_sizes:
        log(f"shardserve: decode step timing at batch {batch_size}")
        steps[batch_size] = decode_step_time(engine, batch_size, settings)
    log(f"shardserve: matmul ({settings.matmul_n}^3 {dtype}) and copy bandwidth "
        f"({settings.bandwidth_bytes // MIB} MiB)")
    flop_s = matmul_flop_s(dtype, settings.matmul_n, settings.matmul_reps)
    bandwidth_bytes_s = copy_bandwidth_bytes_s(settings.bandwidth_bytes, settings.bandwidth_reps)
    dtype_bytes = torch.finfo(getattr(torch, dtype)).bits // 8
    mc = engine.model_config
    per_batch = {}
    for batch_size, step in steps.items():
        bound = decode_bound(mc, dtype_bytes, batch_size, step["avg_context_tok"], flop_s, bandwidth_bytes_s)
        per_batch[str(batch_size)] = {**step, **bound, "efficiency": bound["bound_s"] / step["step_s"]}
    prefill = {"num_tokens": PREFILL_TOKENS, "time_s": prefill_s, "flops": prefill_flops(mc, PREFILL_TOKENS)}
    prefill["flop_s"] = prefill["flops"] / prefill_s
    prefill["efficiency"] = prefill["flop_s"] / flop_s
    return {"matmul_flop_s": flop_s, "bandwidth_bytes_s": bandwidth_bytes_s, "dtype_bytes": dtype_bytes, "prefill": prefill,
            "num_params": mc.num_params, "weights_bytes": mc.num_params * dtype_bytes,
            "kv_bytes_per_token": mc.kv_bytes_per_token(dtype_bytes), "per_batch": per_batch}


# --- vLLM, in its own venv --------------------------------------------------------------------------
def vllm_offline(args, workloads: dict[str, Workload]) -> dict:
    """vLLM's LLM.generate on the same prompts (same weights, dtype): per bind, tok/s per workload;
    `best` is the bind with the higher uniform throughput."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_reference import BINDS, ensure_vllm, hf_folder, offline_generate

    python, folder = ensure_vllm(), hf_folder()
    jobs = {name: {"prompts": w.prompts, "output_lens": w.output_lens, "warmup_prompts": w.warmup_prompts}
            for name, w in workloads.items()}
    runs = {}
    for bind in BINDS if args.vllm_bind == "both" else (args.vllm_bind,):
        log(f"vllm: LLM.generate with VLLM_CPU_OMP_THREADS_BIND={bind} (compiles first: 1-3 min)")
        runs[bind] = offline_generate(python, folder, args.dtype, jobs, bind)
        log(f"vllm bind={bind}: " + ", ".join(f"{n} {r['tok_s']:.1f} tok/s" for n, r in runs[bind].items()))
    best = max(runs, key=lambda b: runs[b]["uniform"]["tok_s"])
    return {"best": best, "runs": runs, **runs[best]}


# --- Hugging Face child ---------------------------------------------------------------------------
def hf_child(dtype: str, workloads: dict[str, Workload], settings: Settings) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from shardserve.models.checkpoint import resolve_model_path

    # Its GGUF warnings claim packed weights for this file, but llama GGUFs are dequantized into
    # plain nn.Linear (recorded below as hf_linear), so keep stderr to our own progress lines.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path("smollm2")
    log(f"hf: loading {path.name} ({dtype})")
    start_s = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    model.eval()
    linear = model.model.layers[0].mlp.down_proj
    result = {"load_s": time.perf_counter() - start_s, "rss_after_load_mib": peak_rss_mib(),
              "hf_linear": f"{type(linear).__name__} {linear.weight.dtype}", "transformers": transformers.__version__}
    uniform = {}
    for batch_size in settings.hf_batch_sizes:
        uniform[str(batch_size)] = hf_static_batches(model, workloads["uniform"], batch_size, settings)
    best = max(uniform.values(), key=lambda r: r["tok_s"])
    result["uniform"] = {**best, "by_batch_size": {bs: _without_tokens(r) for bs, r in uniform.items()}}
    result["uniform_peak_rss_mib"] = peak_rss_mib()
    result["mixed"] = hf_static_batches(model, workloads["mixed"], best["batch_size"], settings)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def _without_tokens(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "first_tokens"}


def hf_generate(model, prompts: list[list[int]], new_tokens: int):
    """One static batch, left-padded with EOS; returns only the generated ids [batch, new_tokens]."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), EOS_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, pad_token_id=EOS_ID,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    generated = out[:, width:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"hf generated {generated.shape[1]} tokens per row, asked for {new_tokens}")
    return generated


def hf_static_batches(model, workload: Workload, batch_size: int, settings: Settings) -> dict:
    """Time `workload` in arrival-order static batches; a batch runs to its longest output."""
    from tqdm import tqdm

    num_requests = len(workload.prompts) if batch_size > 1 else min(settings.hf_batch1_requests, len(workload.prompts))
    batches = [list(range(i, min(i + batch_size, num_requests))) for i in range(0, num_requests, batch_size)]
    log(f"hf: {workload.name} batch {batch_size} start ({num_requests} requests, {len(batches)} batches)")
    hf_generate(model, [workload.prompts[i] for i in batches[0]], 4)
    useful_tok = computed_tok = 0
    first_tokens = []
    start_s = time.perf_counter()
    for batch in tqdm(batches, desc=f"hf {workload.name} b{batch_size}", unit="batch", file=sys.stderr):
        lens = [workload.output_lens[i] for i in batch]
        generated = hf_generate(model, [workload.prompts[i] for i in batch], max(lens))
        useful_tok += sum(lens)
        computed_tok += max(lens) * len(batch)
        first_tokens += [row[:COMPARED_TOKENS] for row in generated.tolist()]
    wall_s = time.perf_counter() - start_s
    log(f"hf: {workload.name} batch {batch_size} done, {useful_tok / wall_s:.1f} tok/s")
    return {"batch_size": batch_size, "num_requests": num_requests, "useful_tokens": useful_tok,
            "generated_tokens": computed_tok, "wasted_fraction": 1 - useful_tok / computed_tok,
            "wall_s": wall_s, "tok_s": useful_tok / wall_s, "first_tokens": first_tokens}


# --- report -----------------------------------------------------------------------------------------
def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far the two systems' greedy outputs agree: a sanity check that both run the same model
    (bf16 rounding differs, so late divergence is expected)."""
    pairs = list(zip(ours, theirs))
    if not pairs:
        return {"requests": 0}
    prefix_lens = []
    for a, b in pairs:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix_lens.append(n)
    return {"requests": len(pairs), "first_token_match": sum(n > 0 for n in prefix_lens) / len(pairs),
            "mean_common_prefix_tok": statistics.fmean(prefix_lens), "compared_tok": COMPARED_TOKENS}


def summarize(args, settings: Settings, ss: dict, hf: dict | None, vllm: dict | None) -> dict:
    eff = ss["decode_efficiency"]
    limit_bytes = eff["weights_bytes"] + KV_CACHE_BYTES + RSS_HEADROOM_BYTES
    ss_rss_mib = ss["uniform"]["peak_rss_mib"]
    result = {
        "uniform_ratio_vs_hf": ss["uniform"]["tok_s"] / hf["uniform"]["tok_s"] if hf else None,
        "mixed_ratio_vs_hf": ss["mixed"]["tok_s"] / hf["mixed"]["tok_s"] if hf else None,
        "shardserve_tok_s": ss["uniform"]["tok_s"],
        "hf_tok_s": hf["uniform"]["tok_s"] if hf else None,
        "shardserve_mixed_tok_s": ss["mixed"]["tok_s"],
        "hf_mixed_tok_s": hf["mixed"]["tok_s"] if hf else None,
        "hf_best_batch_size": hf["uniform"]["batch_size"] if hf else None,
        "uniform_ratio_vs_vllm": ss["uniform"]["tok_s"] / vllm["uniform"]["tok_s"] if vllm else None,
        "mixed_ratio_vs_vllm": ss["mixed"]["tok_s"] / vllm["mixed"]["tok_s"] if vllm else None,
        "vllm_tok_s": vllm["uniform"]["tok_s"] if vllm else None,
        "vllm_mixed_tok_s": vllm["mixed"]["tok_s"] if vllm else None,
        "vllm_bind": vllm["best"] if vllm else None,
    }
    for bs, row in eff["per_batch"].items():
        result[f"decode_efficiency_b{bs}"] = row["efficiency"]
    result["prefill_efficiency_1024"] = eff["prefill"]["efficiency"]
    target = eff["per_batch"].get(str(EFFICIENCY_TARGET_BATCH))
    result.update({
        "decode_efficiency_target_met": target["efficiency"] >= EFFICIENCY_TARGET if target else None,
        "shardserve_uniform_peak_rss_mib": ss_rss_mib,
        "hf_uniform_peak_rss_mib": hf["uniform_peak_rss_mib"] if hf else None,
        "memory_limit_mib": limit_bytes / MIB,
        "under_memory_limit": ss_rss_mib * MIB <= limit_bytes,
        "dtype": args.dtype,
        "quick": args.quick,
    })
    return result


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_throughput_table(result: dict, ss: dict, hf: dict | None) -> None:
    print(f"\noffline throughput, smollm2, {result['dtype']}{' (quick)' if result['quick'] else ''}")
    print(f"{'workload':<9} {'requests':>8} {'shardserve tok/s':>17} {'HF tok/s':>9} {'HF batch':>8} "
          f"{'HF waste':>8} {'ratio':>6}")
    for name in ("uniform", "mixed"):
        h = hf[name] if hf else None
        waste = f"{100 * h['wasted_fraction']:.0f}%" if h else "-"
        print(f"{name:<9} {ss[name]['num_requests']:>8} {ss[name]['tok_s']:>17.1f} "
              f"{_fmt(h and h['tok_s']):>9} {_fmt(h and h['batch_size'], 'd'):>8} {waste:>8} "
              f"{_fmt(result[f'{name}_ratio_vs_hf'], '.2f'):>6}")
    if result["vllm_tok_s"]:
        print(f"vLLM LLM.generate (bind {result['vllm_bind']}): uniform {result['vllm_tok_s']:.1f} tok/s "
              f"(ratio {result['uniform_ratio_vs_vllm']:.2f}), mixed {result['vllm_mixed_tok_s']:.1f} tok/s "
              f"(ratio {result['mixed_ratio_vs_vllm']:.2f})")
    if hf:
        by_bs = ", ".join(f"b{bs}: {r['tok_s']:.1f}" + (f" ({r['num_requests']} req)" if bs == "1" else "")
                          for bs, r in hf["uniform"]["by_batch_size"].items())
        print(f"HF uniform tok/s by batch size: {by_bs}   [HF linear: {hf['hf_linear']}]")
        agree = greedy_agreement(ss["uniform"]["first_tokens"], hf["uniform"]["first_tokens"])
        print(f"greedy agreement (uniform, {agree['requests']} req): first token "
              f"{100 * agree['first_token_match']:.0f}%, mean common prefix "
              f"{agree['mean_common_prefix_tok']:.1f}/{COMPARED_TOKENS} tok")


def print_memory(result: dict, ss: dict) -> None:
    eff = ss["decode_efficiency"]
    print(f"peak RSS MiB: shardserve uniform {result['shardserve_uniform_peak_rss_mib']:.0f} "
          f"(whole child {ss['peak_rss_mib']:.0f}), HF uniform {_fmt(result['hf_uniform_peak_rss_mib'], '.0f')}")
    print(f"memory limit: shardserve uniform peak RSS {result['shardserve_uniform_peak_rss_mib']:.0f} MiB vs "
          f"{result['memory_limit_mib']:.0f} MiB (weights {eff['weights_bytes'] / MIB:.0f} "
          f"+ KV {KV_CACHE_BYTES // MIB} + {RSS_HEADROOM_BYTES // MIB}): "
          f"{'under' if result['under_memory_limit'] else 'OVER'}")


def print_decode_efficiency(eff: dict) -> None:
    print(f"machine: matmul {eff['matmul_flop_s'] / 1e9:.1f} GFLOP/s, "
          f"copy bandwidth {eff['bandwidth_bytes_s'] / 1e9:.1f} GB/s")
    for bs, row in eff["per_batch"].items():
        limiter = "compute" if row["compute_bound_s"] >= row["memory_bound_s"] else "memory"
        print(f"decode batch {bs:>3}: step {1e3 * row['step_s']:.2f} ms (median; mean "
              f"{1e3 * row['mean_step_s']:.2f}) at context {row['avg_context_tok']:.0f}, "
              f"bound {1e3 * row['bound_s']:.2f} ms ({limiter}), efficiency {100 * row['efficiency']:.0f}%")
    pf = eff["prefill"]
    print(f"prefill {pf['num_tokens']} tokens: {1e3 * pf['time_s']:.0f} ms (median), {pf['flop_s'] / 1e9:.1f} GFLOP/s, "
          f"{100 * pf['efficiency']:.0f}% of the matmul's (target >= {100 * EFFICIENCY_TARGET:.0f}%: "
          f"{'met' if pf['efficiency'] >= EFFICIENCY_TARGET else 'NOT met'})")
    target = eff["per_batch"].get(str(EFFICIENCY_TARGET_BATCH))
    if target is None:
        verdict = "not measured (--quick)"
    else:
        met = target["efficiency"] >= EFFICIENCY_TARGET
        verdict = f"{100 * target['efficiency']:.0f}% -> {'met' if met else 'NOT met'}"
    print(f"target: decode efficiency >= {100 * EFFICIENCY_TARGET:.0f}% at batch {EFFICIENCY_TARGET_BATCH}: {verdict}")


def write_results(result: dict, args, settings: Settings, ss: dict, hf: dict | None, vllm: dict | None) -> Path:
    def strip(system: dict | None):
        if system is None:
            return None
        return {k: _without_tokens(v) if isinstance(v, dict) else v for k, v in system.items()}

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    # A quick run gets its own file so it never overwrites the numbers of a full run.
    path = RESULTS_DIR / f"offline_throughput_{args.dtype}{'_quick' if args.quick else ''}.json"
    details = {"settings": dataclasses.asdict(settings), "shardserve": strip(ss), "hf": strip(hf),
               "vllm": vllm and vllm["runs"]}
    path.write_text(json.dumps({**result, "details": details}, indent=2) + "\n")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="small smoke version, under a minute")
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--skip-vllm", action="store_true", help="leave vLLM's LLM.generate out")
    parser.add_argument("--vllm-bind", choices=("auto", "0-1", "both"), default="both",
                        help="vLLM's VLLM_CPU_OMP_THREADS_BIND; both: run each, compare the faster")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    workloads = build_workloads(settings)
    start_s = time.perf_counter()
    log("phase shardserve: start")
    ss = run_in_child(shardserve_child, dtype=args.dtype, workloads=workloads, settings=settings)
    log(f"phase shardserve: done ({time.perf_counter() - start_s:.0f} s)")
    vllm = None
    if not args.skip_vllm:
        log("phase vllm: start")
        vllm = vllm_offline(args, workloads)
        log(f"phase vllm: done ({time.perf_counter() - start_s:.0f} s)")
    hf = None
    if not args.skip_hf:
        log("phase hf: start")
        hf = run_in_child(hf_child, dtype=args.dtype, workloads=workloads, settings=settings)
        log(f"phase hf: done ({time.perf_counter() - start_s:.0f} s)")
    result = summarize(args, settings, ss, hf, vllm)
    print_throughput_table(result, ss, hf)
    print_memory(result, ss)
    print_decode_efficiency(ss["decode_efficiency"])
    path = write_results(result, args, settings, ss, hf, vllm)
    log(f"wrote {path} ({time.perf_counter() - start_s:.0f} s in all)")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
