"""One prepared check for a lent GPU: correctness first, then what the device does with our path.

1. correctness: tests/gpu (the engine in bfloat16 on CUDA, Triton backend, against transformers,
   dense and MoE) and the Triton kernel tests compiled for the device; then the largest relative
   logit error against transformers over the tiny dense and MoE checkpoints, measured here.
2. a random-weight model of Llama-3-8B's shape in bfloat16 (our model classes, the Triton
   attention backend, a paged KV cache): decode steps at batch 1, 8, 64 and 256 over a 1,024-token
   context, replayed from CUDA graphs as the engine does (and eagerly, for comparison), with
   MBU = (weights + KV read) / step time / the device's measured copy bandwidth;
   prefill of 1k, 4k and 16k tokens with MFU = FLOPs / time / the measured bf16 matmul rate.
3. fp8 weights (`--quantization fp8`): the same decode steps with the layers' weights in fp8;
   fp8_speedup_b1 = the bf16 batch-1 step time / the fp8 one (fp8_speedup_b1_gemv: with the
   other decode kernel, gpu_kernels/fp8_linear.py's "gemv"), and each linear shape alone at one row.
4. serving: `shardserve serve` of the embedded model on the GPU and `shardserve bench` at
   concurrency 32, output tokens/s and TTFT/TPOT.

Every section runs under its own time budget and records its error instead of stopping the
rest, so one failure still leaves the others' figures. Writes benchmarks/results/gpu_*.json and
prints `RESULT {"mbu_b1", "mfu_prefill_4k", "fp8_speedup_b1", "max_rel_logit_err", ...}` last.
Budget: under 8 minutes on an H200.

    python benchmarks/gpu_check.py [--quick] [--serve-model DIR]
    python benchmarks/gpu_check.py --export-embedded-shape DIR   # here, before: what travels to the device

On this workplace's lent H200 (session 21: torch 2.11, Triton 3.6, transformers 5.17 there, no
registry): the packages its image lacks travel as cp312 wheels in `.whl/` (fastapi, starlette,
pydantic, pydantic-core, annotated-types, typing-inspection, opentelemetry-api, uvicorn, httptools,
gguf, llguidance; `pip download --no-deps --only-binary=:all: --python-version 3.12` per the device
tool's README), the serve model's shape in `.gpu_carry/` (both git-excluded, both carried), and
one call does it all in about 2 minutes (`--quick`):

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/gpu_check.py --quick --serve-model .gpu_carry/smollm2_shape
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def timed_cuda(fn, iters: int) -> float:
    """Mean seconds of fn() over `iters` runs after two warm-ups, by CUDA events."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def timed_graph(fn, iters: int) -> float:
    """Mean seconds of fn() replayed from a CUDA graph of `iters` calls: the device's time for it,
    without the host's cost of launching its kernels one by one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes here
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return timed_cuda(graph.replay, 3) / iters


def device_peaks() -> dict:
    """Copy bandwidth (read + write of a 2 GiB buffer) and the bf16 matmul rate (8192^3)."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed_cuda(lambda: dst.copy_(src), 10)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = timed_cuda(lambda: a @ b, 10)
    return {"copy_bytes_s": 2 * src.numel() * 2 / copy_s, "bf16_matmul_flop_s": 2 * 8192**3 / mm_s}


def correctness(quick: bool) -> dict:
    out: dict = {}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu", "tests/layers/test_gpu_kernels.py",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    out["pytest_rc"] = proc.returncode
    out["pytest_tail"] = proc.stdout[-1500:]
    import tempfile

    import transformers

    from shardserve.llm import LLM
    from tests.conftest import write_tiny_checkpoint
    from tests.engine_helpers import engine_logits, relative_error

    errors = {}
    try:  # the pytest figures above stay in the report whatever fails here
        with tempfile.TemporaryDirectory() as tmp:
            for family in ("llama3", "qwen3_moe") if quick else ("llama3", "qwen3", "mixtral", "qwen3_moe"):
                path = write_tiny_checkpoint(Path(tmp) / family, family, well_conditioned=True)
                ours = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 << 20,
                           max_model_len=512, show_progress=False)
                ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
                ids = list(range(3, 60))
                with torch.no_grad():
                    expected = ref(torch.tensor([ids], device="cuda")).logits[0].float()
                errors[family] = max(relative_error(engine_logits(ours.engine, ids, chunk).float(), expected)
                                     for chunk in (10**6, 7, 1))
                # the noise floor: transformers' own bfloat16 against its float32
                with torch.no_grad():
                    exact = ref.float()(torch.tensor([ids], device="cuda")).logits[0]
                out.setdefault("hf_bf16_vs_fp32", {})[family] = relative_error(expected, exact)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-2000:]
    out["rel_logit_err"] = errors
    out["max_rel_logit_err"] = max(errors.values(), default=None)
    return out


def build_llama8b(max_tokens: int):
    """Our Llama model of Llama-3-8B's shape with random weights on the GPU, its KV cache and the
    Triton backend."""
    from shardserve.config import ModelConfig
    from shardserve.engine.kv_cache import KVCache
    from shardserve.layers.attention.triton_backend import TritonAttention
    from shardserve.models.registry import model_class

    config = ModelConfig.from_hf_config(LLAMA3_8B)
    attention = TritonAttention()
    with torch.device("cuda"):
        model = model_class("llama")(config, torch.bfloat16, config.max_position_embeddings, None, attention)
    for p in model.parameters():
        p.data.normal_(std=0.02)
    model.eval()
    kv = KVCache.allocate(model.kv_shape, -(-max_tokens // 16) + 64, 16, torch.bfloat16, torch.device("cuda"))
    return config, model, kv, attention


class _Cache:
    def __init__(self, kv):
        self.num_blocks, self.block_size, self.dtype = kv.num_blocks, kv.block_size, kv.dtype
        self.num_kv_heads, self.device = kv.layers[0].shape[1], kv.layers[0].device


@torch.inference_mode()
def decode_step_s(model, graphs, kv, attention, cache, vocab_size: int, batch: int, context: int) -> float:
    """Seconds of one decode step of `batch` sequences at `context` tokens each (their blocks
    side by side in the pool), with the LM head: replayed from `graphs`, or eager when None."""
    from shardserve.layers.attention.paged_kv import SeqSpan

    blocks_per_seq = -(-(context + 1) // 16)
    spans = [SeqSpan(context, 1, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch)]
    meta = attention.build_metadata(spans, batch, cache)
    ids = torch.randint(0, vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), context, device="cuda")
    if graphs is None:
        return timed_cuda(lambda: model.compute_logits(model(ids, pos, kv.layers, meta)), 10)
    return timed_cuda(lambda: model.compute_logits(graphs.run(ids, pos, meta)), 10)


def throughput(peaks: dict, quick: bool) -> dict:
    from shardserve.engine.cuda_graphs import DecodeGraphs
    from shardserve.layers.attention.paged_kv import SeqSpan

    context = 1024
    batches = (1, 8, 64) if quick else (1, 8, 64, 256)
    prefills = (1024, 4096) if quick else (1024, 4096, 16384)
    config, model, kv, attention = build_llama8b(max(max(batches) * (context + 16), max(prefills) + 16))
    cache = _Cache(kv)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token_bytes = config.kv_bytes_per_token(2)
    out: dict = {"weight_bytes": weight_bytes, "decode": {}, "prefill": {}}
    t0 = time.perf_counter()
    try:  # without graphs the eager figures still come
        graphs = DecodeGraphs(model, kv.layers, attention, cache, max(batches), context + 64)
        out["graph_capture_s"] = time.perf_counter() - t0
    except Exception as exc:
        graphs = None
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
        out["graph_traceback"] = traceback.format_exc()[-2000:]
    for batch in batches:
        eager_s = decode_step_s(model, None, kv, attention, cache, config.vocab_size, batch, context)
        step_s = (decode_step_s(model, graphs, kv, attention, cache, config.vocab_size, batch, context)
                  if graphs else eager_s)
        read = weight_bytes + batch * context * kv_token_bytes
        out["decode"][batch] = {"step_ms": step_s * 1e3, "tok_s": batch / step_s,
                                "mbu": read / step_s / peaks["copy_bytes_s"], "eager_step_ms": eager_s * 1e3}
    with torch.inference_mode():
        for tokens in prefills:
            meta = attention.build_metadata([SeqSpan(0, tokens, list(range(-(-tokens // 16))))], 0, cache)
            ids = torch.randint(0, config.vocab_size, (tokens,), device="cuda")
            pos = torch.arange(tokens, device="cuda")
            step_s = timed_cuda(lambda: model.compute_logits(model(ids, pos, kv.layers, meta)[-1:]), 3)
            flops = 2 * sum(config.active_params_per_layer()) * tokens \
                + 4 * config.num_heads * config.head_dim * config.num_layers * tokens * (tokens + 1) / 2
            out["prefill"][tokens] = {"ms": step_s * 1e3, "tok_s": tokens / step_s,
                                      "mfu": flops / step_s / peaks["bf16_matmul_flop_s"]}
        out["prefill_attention_tiles"] = prefill_tiles(config, kv, prefills)
    del graphs
    out["fp8"] = fp8_decode(model, kv, attention, cache, config, batches, context, weight_bytes, peaks)
    del model, kv
    torch.cuda.empty_cache()
    return out


def export_embedded_shape(dest: Path) -> None:
    """An HF folder of the embedded model's shape and tokenizer, without weights: what travels to a
    lent device, whose transfer limit (64 MiB) the embedded GGUF exceeds. There, `random_weights`
    fills it: the serving figures depend on the shape, not on the weights' values."""
    from shardserve.models.checkpoint import load_checkpoint
    from shardserve.models.tokenizer import load_tokenizer

    checkpoint = load_checkpoint("smollm2")
    c, tokenizer = checkpoint.config, load_tokenizer(checkpoint)
    dest.mkdir(parents=True, exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
          "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
          "eos_token_id": c.eos_token_ids[0], "torch_dtype": "bfloat16"}
    (dest / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    tokenizer.backend.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "add_bos_token": tokenizer.add_bos_token,
         "chat_template": tokenizer.chat_template}, indent=1) + "\n")


def random_weights(folder: Path) -> None:
    """Random bfloat16 weights for an HF folder that has none (see export_embedded_shape)."""
    if any(folder.glob("*.safetensors")):
        return
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)


def fp8_decode(model, kv, attention, cache, config, batches, context, bf16_weight_bytes, peaks) -> dict:
    """The same decode steps with the layers' weights in fp8 (--quantization fp8), through graphs;
    MBU counts the bytes the fp8 model reads (its layers' weights at one byte, the head's at two)."""
    from shardserve.engine.cuda_graphs import DecodeGraphs
    from shardserve.layers.linear import Linear

    model.prepack("fp8")
    torch.cuda.empty_cache()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    weight_bytes = bf16_weight_bytes - sum(m.packed.data.numel() for m in linears)
    graphs = DecodeGraphs(model, kv.layers, attention, cache, max(batches), context + 64)
    out: dict = {"weight_bytes": weight_bytes, "decode": {}}
    for batch in batches:
        step_s = decode_step_s(model, graphs, kv, attention, cache, config.vocab_size, batch, context)
        read = weight_bytes + batch * context * config.kv_bytes_per_token(2)
        out["decode"][batch] = {"step_ms": step_s * 1e3, "tok_s": batch / step_s,
                                "mbu": read / step_s / peaks["copy_bytes_s"]}
    del graphs
    try:  # batch 1 again with the other decode kernel (fp8_linear.py's "gemv")
        for m in linears:
            m.packed.decode_kernel = "gemv"
        graphs = DecodeGraphs(model, kv.layers, attention, cache, 1, context + 64)
        out["gemv_b1_step_ms"] = decode_step_s(model, graphs, kv, attention, cache, config.vocab_size, 1, context) * 1e3
        del graphs
    except Exception as exc:
        out["gemv_b1_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for m in linears:
            m.packed.decode_kernel = "dot"
    try:
        out["linear_m1"] = fp8_linear_shapes(config)
    except Exception as exc:
        out["linear_m1"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def fp8_linear_shapes(config) -> dict:
    """One row through each of the model's linear shapes, timed in CUDA graphs: the weight's GB/s
    read in bf16 (F.linear), in fp8 through our weight-only kernel, and through torch._scaled_mm
    (the GEMM alone, the activation already quantized)."""
    import torch.nn.functional as F

    from shardserve.layers.gpu_kernels.fp8_linear import fp8_weight_linear
    from shardserve.layers.quantization import Fp8Weight, quantize_rows

    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    out = {}
    for n, k in ((qkv, h), (h, config.num_heads * config.head_dim), (2 * i, h), (h, i)):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        fp8 = Fp8Weight(w)
        xq, xs = quantize_rows(x)
        times = {"bf16": timed_graph(lambda: F.linear(x, w), 20),
                 "fp8_triton": timed_graph(lambda: fp8_weight_linear(x, fp8.data, fp8.scale.view(-1)), 20),
                 "fp8_triton_gemv": timed_graph(lambda: fp8_weight_linear(x, fp8.data, fp8.scale.view(-1), "gemv"),
                                                20),
                 "fp8_scaled_mm_gemm": timed_graph(lambda: torch._scaled_mm(xq, fp8.data.t(), scale_a=xs,
                                                                           scale_b=fp8.scale, out_dtype=x.dtype), 20)}
        out[f"{n}x{k}"] = {name: {"us": s * 1e6, "gb_s": n * k * (2 if name == "bf16" else 1) / s / 1e9}
                           for name, s in times.items()}
    return out


PREFILL_TILES = ((16, 16, 4), (64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8))  # block_m, block_n, warps


def prefill_tiles(config, kv, prefills) -> dict:
    """The prefill attention kernel alone over one whole prompt, per tile shape: ms and TFLOP/s
    (causal: 4 H D T (T + 1) / 2)."""
    from shardserve.layers.gpu_kernels.paged_attention import prefill_attention

    out: dict = {}
    heads, dim = config.num_heads, config.head_dim
    for tokens in prefills:
        q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
        result = torch.empty_like(q)
        one = torch.zeros(1, dtype=torch.int32, device="cuda")
        lens = torch.full((1,), tokens, dtype=torch.int32, device="cuda")
        table = torch.arange(-(-tokens // 16), dtype=torch.int32, device="cuda")[None]
        flops = 4 * heads * dim * tokens * (tokens + 1) / 2
        for block_m, block_n, warps in PREFILL_TILES:
            key = f"{tokens}:{block_m}x{block_n}w{warps}"
            try:  # a tile too large for the device's shared memory fails alone
                seconds = timed_cuda(lambda: prefill_attention(result, q, kv.layers[0][0], kv.layers[0][1], one, lens,
                                                               lens, table, dim**-0.5, tokens, block_m, block_n, warps), 5)
                out[key] = {"ms": seconds * 1e3, "tflop_s": flops / seconds / 1e12}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def serving(quick: bool, model: str) -> dict:
    from shardserve.ports import free_port
    from shardserve.server.process import server_process

    if Path(model).is_dir():
        random_weights(Path(model))
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", model, "--device", "cuda", "--dtype", "bfloat16",
           "--port", str(port), "--log-level", "warning"]
    result = RESULTS / "gpu_serve_bench.json"
    with server_process(cmd, port, startup_timeout_s=180) as (base_url, _):
        subprocess.run([sys.executable, "-m", "shardserve.cli", "bench", "--base-url", base_url, "--concurrency", "32",
                        "--num-requests", "64" if quick else "256", "--input-len", "128", "--output-len", "128",
                        "--no-progress", "--result-json", str(result)], cwd=ROOT, check=True, timeout=240)
    level = json.loads(result.read_text())["results"][0]
    return {"output_throughput_tok_s": level["output_throughput_tok_s"],
            "ttft_p50_ms": level["ttft"]["p50_ms"], "tpot_p50_ms": level["tpot"]["p50_ms"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a tighter device budget)")
    parser.add_argument("--serve-model", default="smollm2",
                        help="the served model: 'smollm2', or an HF folder (random weights filled in when it has none)")
    parser.add_argument("--export-embedded-shape", type=Path, metavar="DIR",
                        help="on this host: write the embedded model's config and tokenizer to DIR for a device, then exit")
    args = parser.parse_args()
    if args.export_embedded_shape:
        export_embedded_shape(args.export_embedded_shape)
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured")
        return 2
    RESULTS.mkdir(exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    started = time.perf_counter()
    sections = [("peaks", device_peaks), ("correctness", lambda: correctness(args.quick)),
                ("throughput", None), ("serving", lambda: serving(args.quick, args.serve_model))]
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            report[name] = throughput(report["peaks"], args.quick) if name == "throughput" else fn()
        except Exception as exc:  # keep going: the other sections still measure
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        report.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_check] {name} done in {report['section_s'][name]} s", flush=True)
        (RESULTS / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    decode = report.get("throughput", {}).get("decode", {})
    prefill = report.get("throughput", {}).get("prefill", {})
    fp8 = report.get("throughput", {}).get("fp8", {}).get("decode", {})
    fp8_gemv_ms = report.get("throughput", {}).get("fp8", {}).get("gemv_b1_step_ms")
    result = {
        "mbu_b1": decode.get(1, {}).get("mbu"), "mfu_prefill_4k": prefill.get(4096, {}).get("mfu"),
        "fp8_speedup_b1": (decode[1]["step_ms"] / fp8[1]["step_ms"]) if 1 in decode and 1 in fp8 else None,
        "fp8_speedup_b1_gemv": (decode[1]["step_ms"] / fp8_gemv_ms) if 1 in decode and fp8_gemv_ms else None,
        "max_rel_logit_err": report.get("correctness", {}).get("max_rel_logit_err"),
        "decode_tok_s": {b: d.get("tok_s") for b, d in decode.items()},
        "serve_output_tok_s_c32": report.get("serving", {}).get("output_throughput_tok_s"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report["result"] = result
    (RESULTS / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print("RESULT " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
