"""The planner against published, measured GPU results (benchmarks/planner_published.yaml).

Every row of the YAML names its source (TensorRT-LLM's performance tables and blogs, MLPerf
Inference logs, SGLang's deployment posts) and gives what was measured there: a model, a GPU and
how many, a layout where published, a dtype, prompt and output lengths, a load (offline, a
closed loop of clients, a request rate) and throughput and, for some, TTFT and TPOT. Each row the
planner can express is predicted with the cost model (shardserve/planner: Deployment, ReplicaModel)
on the catalog device, uncalibrated, and compared: relative error |predicted - published| /
published, throughput rows and latency rows apart.

How a row becomes a prediction
- model: the planner's preset for the checkpoint (Llama-3.3-70B has Llama-3.1-70B's shape,
  DeepSeek-R1 DeepSeek-V3's); dtype fp16/bf16/fp8/nvfp4 -> float16/bfloat16/float8/float4.
- layout: the published tp (and ep); "DEP n" and `enable_attention_dp` rows are tp1 epN with
  data-parallel attention; replicas = GPUs / GPUs per replica.
- offline rows (max throughput, every request at once) are the run the source made: its stated
  number of requests (NUM_REQUESTS) queued at once and served in waves as deep as the engine
  takes, to the end of the last, smaller wave (ReplicaModel.predict_offline), with the engine
  limits trtllm-bench derives when a table leaves them at their defaults (`trtllm_bench_limits`,
  restating tensorrt_llm/bench/build/tuning.py: its own KV estimate, a batch at most 4096, a
  step budget of batch x (1 + isl / osl) tokens, between 2048 and 32768), per rank under
  attention DP, and never more sequences than the planner's KV capacity.
  Rows whose source gives its settings override them (ROW_SETTINGS); a stated KV-cache dtype
  other than the weights' is passed on (Deployment.kv_dtype).
- host runtime: rows of TensorRT-LLM's PyTorch backend (PYTHON_RUNTIME_SOURCES) carry its host
  cost per sequence per step (PYTHON_RUNTIME_SEQ_OVERHEAD_S, from TensorRT-LLM's own
  measurement, not fitted here); the C++ runtime rows keep the planner's priors. Concurrency rows are a
  closed loop of that many clients; request-rate rows Poisson traffic at that rate (TTFT and
  TPOT compared).
- not expressed, and counted as such: rows without a published prompt length (MLPerf's logs
  give none), speculative-decoding rows, disaggregated pools' one-sided figures, devices and
  models outside the catalog and presets.

Calibration: one Efficiency per dtype family (16-bit, fp8, fp4) and kind (dense, MoE): gemm,
weight and KV-cache memory factors and the step overhead, fitted by grid search on the
calibration subset -- the rows at even positions of each group in file order -- and scored on
the other rows only (held out).

Run
    .venv/bin/python benchmarks/planner_published.py [--rows FILE] [--show]
A few seconds. Prints every row's prediction (with --show), the error by group, and last
`RESULT {"rows", "median_error", "p90_error", "calibrated_median_error", ...}` (throughput rows;
also benchmarks/results/planner_published.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardserve.config import ConfigError, ParallelConfig
from shardserve.dtypes import kv_bytes_of
from shardserve.planner.cost_model import Deployment
from shardserve.planner.efficiency import Efficiency
from shardserve.planner.hardware import get_hardware, load_catalog
from shardserve.planner.model_presets import preset
from shardserve.planner.replica_model import ReplicaModel, Workload
from shardserve.planner.search import SearchSpace, kv_capacity_seqs

HERE = Path(__file__).resolve().parent
# Engine settings a row's source states (the blog's trtllm-bench command lines).
ROW_SETTINGS = {
    "trtllm-blog-dsr1-h200-maxtput": {"max_batch": 128, "token_budget": 1151, "dp_attention": True},
    "trtllm-blog-dsr1-b200-maxtput-fp16kv": {"max_batch": 384, "token_budget": 1536, "dp_attention": True},
}
# Engines whose host runtime is Python (TensorRT-LLM's PyTorch backend, from v0.19 on) pay host
# time per sequence in every step; the TensorRT engines of v0.14-v0.17 schedule in C++.
PYTHON_RUNTIME_SOURCES = ("trtllm10", "trtllm-latest", "trtllm-blog")
# Host seconds per sequence per step of that runtime, a prior not fitted here: TensorRT-LLM's own
# measurement (NVIDIA/TensorRT-LLM pull request #10273: GB200, attention DP 2, max_batch_size
# 1536, 1k/1k, host-bound) was 45.1 ms of host time per iteration for up to 1536 sequences per
# rank, about 30 us a sequence. The C++ runtimes of the older tables keep the plain prior.
PYTHON_RUNTIME_SEQ_OVERHEAD_S = 30e-6
# How many requests an offline row's benchmark ran ($num_requests, fixed per ISL/OSL in each
# document's "Preparing a Dataset" table; the v0.14 online table: 500 requests), by row id prefix.
# A run of N requests ends when its last wave does (ReplicaModel.predict_offline).
_V017_REQUESTS = {(128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (2048, 128): 3000, (2048, 2048): 1500,
                  (5000, 500): 1500, (1000, 1000): 3000, (500, 2000): 3000, (20000, 2000): 1000}
NUM_REQUESTS = {
    "trtllm017": _V017_REQUESTS,
    "trtllm10": {**_V017_REQUESTS, (1000, 2000): 1500},
    "trtllm-latest": {(1024, 1024): 3000, (8192, 1024): 1500, (1024, 8192): 1500, (32768, 1024): 1000,
                      (1024, 32768): 1000},
}
ONLINE_V014_REQUESTS = 500
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": "float8", "nvfp4": "float4", "fp4": "float4"}
FAMILY = {"float16": "16-bit", "bfloat16": "16-bit", "float8": "fp8", "float4": "fp4"}
GPUS = (("gb200", "GB200"), ("h100 nvl", None), ("h200", "H200"), ("h100", "H100"), ("b200", "B200"),
        ("a100", "A100 80GB"), ("l40s", "L40S"), ("mi300x", "MI300X"))
# name in the sources -> planner preset (same shape)
MODEL_ALIASES = {"llama-3.3-70b": "llama-3.1-70b", "deepseek-r1-0528": "deepseek-v3", "deepseek-r1": "deepseek-v3"}


@dataclass(frozen=True)
class Case:
    """One expressible row: what to predict and what was published."""

    id: str
    group: dict[str, str]  # kind (dense/moe), family, gpu, source
    deployment: Deployment
    replicas: int
    isl: int
    osl: int
    load: str  # "offline", "concurrency", "rate"
    load_value: float  # clients per replica, or requests/s per replica (0 offline)
    max_batch: int  # per attention group (the engine's max_batch_size is per rank)
    token_budget: int  # per attention group
    python_runtime: bool  # host runtime in Python (PYTHON_RUNTIME_SOURCES)
    num_requests: int | None  # offline rows: how many the run served (NUM_REQUESTS); None: steady state
    published: dict[str, float]  # metric name -> value (throughput per GPU in tok/s, ms)


def _dtype(text: str) -> str | None:
    return DTYPES.get(str(text).split()[0].lower())


def _gpu(text: str) -> str | None:
    low = str(text).lower()
    return next((name for key, name in GPUS if key in low), None)


def _model(name: str):
    short = name.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    return preset(MODEL_ALIASES.get(short, short))


def _layout(row: dict, settings: dict) -> ParallelConfig:
    tp, ep, dp, n = row.get("tp"), row.get("ep"), row.get("dp"), row["num_gpus"]
    if settings.get("dp_attention") or (dp and ep and dp == ep):
        return ParallelConfig(tp_size=1, ep_size=ep or n, dp_attention=True)
    return ParallelConfig(tp_size=tp or 1, ep_size=ep or 1)


def _published(row: dict) -> dict[str, float]:
    m, n = row["metrics"], row["num_gpus"]
    out = {}
    if "output_tok_s_per_gpu" in m:
        out["output_tok_s_per_gpu"] = float(m["output_tok_s_per_gpu"])
    elif "output_tok_s" in m:
        out["output_tok_s_per_gpu"] = float(m["output_tok_s"]) / n
    for name, key in (("ttft_ms", "ttft_ms_mean"), ("tpot_ms", "itl_ms_mean")):
        if key in m:
            out[name] = float(m[key])
    return out


def expressible(row: dict, catalog) -> tuple[Case | None, str]:
    """(the case, "") or (None, why the planner cannot express the row)."""
    if row.get("speculative"):
        return None, "speculative decoding"
    if row.get("disaggregated"):
        return None, "one pool of a disaggregated deployment"
    if not row.get("isl") or not row.get("osl"):
        return None, "no published prompt/output length"
    model, gpu, dtype = _model(row["model"]), _gpu(row["gpu"]), _dtype(row["dtype"])
    if model is None or gpu is None or dtype is None:
        return None, f"not in the presets/catalog: {row['model']}, {row['gpu']}, {row['dtype']}"
    settings = ROW_SETTINGS.get(row["id"], {})
    par = _layout(row, settings)
    kv_dtype = _dtype(row["kv_dtype"]) if row.get("kv_dtype") else None
    try:
        dep = Deployment(model, par, get_hardware(gpu, catalog), dtype,
                         kv_dtype=kv_dtype if kv_dtype and kv_bytes_of(kv_dtype) != kv_bytes_of(dtype) else None)
    except ConfigError as exc:
        return None, f"layout: {exc}"
    if row["num_gpus"] % par.world_size:
        return None, f"{row['num_gpus']} GPUs is not a multiple of the layout's {par.world_size}"
    replicas = row["num_gpus"] // par.world_size
    load = row["load"]
    if load == "offline":
        kind, value = "offline", 0.0
    elif isinstance(load, dict) and "concurrency" in load:
        kind, value = "concurrency", load["concurrency"] / replicas
    elif isinstance(load, dict) and "request_rate" in load and "scenario" not in load:
        kind, value = "rate", load["request_rate"] / replicas
    else:
        return None, f"load {load!r}"
    published = _published(row)
    if kind == "rate":  # a throughput at a fixed rate is the rate: only latencies say anything
        published.pop("output_tok_s_per_gpu", None)
    if not published:
        return None, "no metric the planner predicts"
    source = row["id"].split("-")[0]
    group = {"kind": "moe" if model.is_moe else "dense", "family": FAMILY[dtype], "gpu": gpu, "source": source}
    derived_batch, derived_budget = trtllm_bench_limits(dep, row["isl"], row["osl"])
    python_runtime = row["id"].startswith(PYTHON_RUNTIME_SOURCES)
    return Case(row["id"], group, dep, replicas, row["isl"], row["osl"], kind, value,
                settings.get("max_batch", derived_batch), settings.get("token_budget", derived_budget), python_runtime,
                num_requests(row) if kind == "offline" else None, published), ""


def num_requests(row: dict) -> int | None:
    """How many requests an offline row's run served in all (its source's $num_requests; the
    replicas share them); None where the source states none."""
    if row["id"].startswith("trtllm014-online"):
        return ONLINE_V014_REQUESTS
    table = next((t for prefix, t in NUM_REQUESTS.items() if row["id"].startswith(prefix + "-")), {})
    return table.get((row["isl"], row["osl"]))


def trtllm_bench_limits(dep: Deployment, isl: int, osl: int) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) as trtllm-bench derives them when a table leaves them
    at their defaults (tensorrt_llm/bench/build/tuning.py, restated): its own KV estimate --
    2 x layers x max(tp, config kv heads) x head size x KV bytes per token, which knows no
    MLA (DeepSeek's config: 128 kv heads of head_dim = qk_rope_head_dim) -- in the GPUs'
    memory (GiB) less the parameters at the weight dtype's bytes, x 0.95, for isl + osl
    tokens per request; the batch capped at 4096 and rounded up (to 32 below 256, 128 below
    1024, else 256, at least 64); the tokens batch x (1 + isl / osl), capped at 32768, rounded
    up (to 256 below 4096 and at least 2048, 512 below 8192, else 1024). The planner's
    own capacity (what the KV cache holds) still bounds the batch."""
    model, par = dep.model, dep.parallel
    tp = par.world_size  # `--tp N` (DEP rows: the whole replica)
    head_size, kv_heads = (model.mla.qk_rope_head_dim, model.num_heads) if model.mla else (model.head_dim,
                                                                                         model.num_kv_heads)
    gib = 1024 ** 3
    token_gib = 2 * model.num_layers * max(tp, kv_heads) * head_size * dep.kv_bytes / gib
    free_gib = dep.hardware.memory_bytes / gib * tp - model.num_params * dep.dtype_bytes / gib
    requests = max(0.0, free_gib * 0.95 / (token_gib * (isl + osl)))
    raw_bs = min(requests, 4096) / par.pp_size
    raw_tokens = min(raw_bs * (1 + isl / osl), 32768)
    def round_up(x: float, step: int) -> int:
        return step * math.ceil(x / step)

    batch = max(64, round_up(raw_bs, 32)) if raw_bs < 256 else round_up(raw_bs, 128 if raw_bs < 1024 else 256)
    tokens = (max(2048, round_up(raw_tokens, 256)) if raw_tokens < 4096
              else round_up(raw_tokens, 512 if raw_tokens < 8192 else 1024))
    return batch, tokens


def predict(case: Case, efficiency: Efficiency) -> dict[str, float]:
    dep = dataclasses.replace(case.deployment, efficiency=efficiency)
    par = dep.parallel
    kv_seqs = kv_capacity_seqs(dep, Workload(case.isl, case.osl, qps=1.0), SearchSpace())
    if kv_seqs < 1:
        return {}
    # per attention group, as the engine's max_batch_size and max_num_tokens are per rank
    max_seqs = min(kv_seqs, case.max_batch * par.attention_groups)
    budget = case.token_budget * par.attention_groups
    replica = ReplicaModel(dep, case.isl, case.osl, max_seqs, budget)
    if case.load == "rate":
        pred = replica.predict(case.load_value)
    elif case.num_requests:  # a finite run: the replicas share the requests
        pred = replica.predict_offline(math.ceil(case.num_requests / case.replicas))
    else:
        pred = replica.predict_closed_loop(int(case.load_value) if case.load == "concurrency" else max_seqs)
    if not pred.stable:
        return {}
    gpus = case.replicas * par.world_size
    return {"output_tok_s_per_gpu": pred.arrival_qps * case.replicas * case.osl / gpus,
            "ttft_ms": pred.ttft_s * 1e3, "tpot_ms": pred.tpot_s * 1e3}


def prior(case: Case, efficiency: Efficiency | None = None) -> Efficiency:
    """`efficiency` (default: the planner's priors) with the host cost of the row's runtime."""
    efficiency = efficiency or Efficiency()
    if not case.python_runtime:
        return efficiency
    return dataclasses.replace(efficiency, seq_overhead_s=PYTHON_RUNTIME_SEQ_OVERHEAD_S)


def errors(cases: list[Case], efficiency_of) -> list[tuple[Case, str, float, float, float]]:
    out = []
    for case in cases:
        pred = predict(case, efficiency_of(case))
        for metric, published in case.published.items():
            value = pred.get(metric, math.inf)
            out.append((case, metric, published, value, abs(value - published) / published))
    return out


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(q * len(values))) - 1)] if values else math.nan


def _summary(errs: list[float]) -> str:
    return f"n={len(errs):3d}  median {statistics.median(errs):6.1%}  p90 {_quantile(errs, 0.9):6.1%}" if errs else "n=0"


def calibration_group(case: Case) -> tuple[str, str]:
    """What one set of factors covers: a dtype family and dense or MoE (MoE kernels -- routing,
    grouped GEMMs, token permutes -- reach another fraction of the peaks than dense ones)."""
    return case.group["family"], case.group["kind"]


CALIBRATION_GROUPS = [(family, kind) for family in ("16-bit", "fp8", "fp4") for kind in ("dense", "moe")]


def calibration_split(cases: list[Case]) -> tuple[list[Case], list[Case]]:
    """The calibration subset (even positions within each calibration group, in file order) and
    the held-out rest."""
    fit, held = [], []
    for group in CALIBRATION_GROUPS:
        members = [c for c in cases if calibration_group(c) == group]
        fit += members[0::2]
        held += members[1::2]
    return fit, held


GRID = {"gemm": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8), "memory": (0.5, 0.6, 0.7, 0.8, 0.9),
        "kv_memory": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), "step_overhead_s": (0.5e-3, 1e-3, 2e-3, 4e-3)}


def fit_family(cases: list[Case]) -> Efficiency:
    """The grid point with the lowest median throughput error on `cases`."""
    best, best_err = Efficiency(), math.inf
    for gemm, memory, kv_memory, overhead in itertools.product(*GRID.values()):
        eff = Efficiency(gemm=gemm, memory=memory, kv_memory=kv_memory, step_overhead_s=overhead, calibrated=True,
                         source="planner_published calibration subset")
        errs = [e for c, m, _, _, e in errors(cases, lambda c: prior(c, eff)) if m == "output_tok_s_per_gpu"]
        err = statistics.median(errs) if errs else math.inf
        if err < best_err:
            best, best_err = eff, err
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=str(HERE / "planner_published.yaml"))
    parser.add_argument("--show", action="store_true", help="print every row's prediction")
    args = parser.parse_args(argv)
    rows = yaml.safe_load(Path(args.rows).read_text())["rows"]
    catalog = load_catalog()
    cases, skipped = [], {}
    for row in rows:
        case, why = expressible(row, catalog)
        if case is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            cases.append(case)
    print(f"{len(rows)} published rows, {len(cases)} expressible; not expressed: "
          + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])))

    uncal = errors(cases, prior)
    if args.show:
        for case, metric, published, value, err in uncal:
            par = case.deployment.parallel
            print(f"  {case.id:58s} {metric:20s} published {published:10.1f}  predicted {value:10.1f}  "
                  f"{err:6.1%}  (tp{par.tp_size} ep{par.ep_size}{' dp' if par.dp_attention else ''} "
                  f"x{case.replicas}, {case.load})")
    throughput = [e for e in uncal if e[1] == "output_tok_s_per_gpu"]
    print("\nuncalibrated, throughput rows:", _summary([e[4] for e in throughput]))
    for key in ("kind", "family", "gpu", "source"):
        for value in sorted({c.group[key] for c, *_ in throughput}):
            print(f"  {key}={value:12s}", _summary([e[4] for e in throughput if e[0].group[key] == value]))
    for metric in ("ttft_ms", "tpot_ms"):
        print(f"uncalibrated, {metric} rows:", _summary([e[4] for e in uncal if e[1] == metric]))

    fit, held = calibration_split(cases)
    fitted = {group: fit_family([c for c in fit if calibration_group(c) == group]) for group in CALIBRATION_GROUPS}
    cal = errors(held, lambda c: prior(c, fitted[calibration_group(c)]))
    cal_throughput = [e[4] for e in cal if e[1] == "output_tok_s_per_gpu"]
    print(f"\ncalibrated on {len(fit)} rows (even positions per dtype family and dense/MoE), "
          f"scored on {len(held)} held-out rows:")
    for (family, kind), eff in fitted.items():
        print(f"  {family} {kind}: gemm {eff.gemm}, memory {eff.memory}, kv_memory {eff.kv_memory}, "
              f"step overhead {eff.step_overhead_s * 1e3:g} ms")
    print("  held-out throughput rows:", _summary(cal_throughput))
    for metric in ("ttft_ms", "tpot_ms"):
        print(f"  held-out {metric} rows:", _summary([e[4] for e in cal if e[1] == metric]))

    result = {
        "rows": len(throughput), "median_error": round(statistics.median(e[4] for e in throughput), 4),
        "p90_error": round(_quantile([e[4] for e in throughput], 0.9), 4),
        "calibrated_median_error": round(statistics.median(cal_throughput), 4),
        "calibrated_rows": len(cal_throughput),
        "ttft_rows": sum(e[1] == "ttft_ms" for e in uncal),
        "ttft_median_error": round(statistics.median([e[4] for e in uncal if e[1] == "ttft_ms"] or [math.nan]), 4),
        "tpot_rows": sum(e[1] == "tpot_ms" for e in uncal),
        "tpot_median_error": round(statistics.median([e[4] for e in uncal if e[1] == "tpot_ms"] or [math.nan]), 4),
        "published_rows": len(rows), "expressible_rows": len(cases),
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "planner_published.json").write_text(json.dumps(result, indent=1) + "\n")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
