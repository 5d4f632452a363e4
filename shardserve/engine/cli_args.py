"""The engine's command-line flags, shared by every command that builds an engine (`serve`,
`generate`, `profile`), and their translation into engine keyword arguments."""
from __future__ import annotations

import argparse
import json

from shardserve.config import QUANTIZATION_METHODS, SchedulerConfig
from shardserve.dtypes import ENGINE_DTYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="HF folder, .gguf file, or 'smollm2' (embedded)")
    parser.add_argument("--dtype", default="float32", choices=ENGINE_DTYPES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                        help="fraction of free memory for the KV cache when --kv-cache-memory is not set "
                             "(default 0.85 on GPU, 0.1 on CPU)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (default: 2048; `serve` on a CPU: 512, for TTFT)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="commit the whole KV pool at start rather than on first use (default: on for "
                             "`serve` on a CPU, off otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="CPU threads per step (default: measured, the fastest of all, half and one)")
    parser.add_argument("--generation-config", default="auto", choices=("auto", "vllm"),
                        help="defaults for sampling fields a request leaves out: the model's own "
                             "(generation_config.json) or vLLM's (temperature 1, top_p 1)")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="load no tokenizer (a checkpoint without one): prompts as token ids, no output text")
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                        help="fp8: the layers' linear weights in float8 with per-row scales, activations per "
                             "token (Hopper/Ada GPUs; on a CPU a reference path, for tests); int8: weight-only "
                             "int8 in blocks of 32 (llama.cpp's Q8_0), activations quantized per block (CPU, "
                             "AVX512-VNNI); gguf: a .gguf checkpoint's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K tensors kept in their "
                             "blocks (CPU), other tensors dequantized to --dtype; implied by a .gguf on a CPU, as in "
                             "vLLM (the embedded model is one); none: a .gguf dequantized to --dtype")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="GPU: no CUDA graphs; every decode step launches its kernels one by one")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                        help="a token's result independent of its batch and of prefill vs decode, so a stream "
                             "resumed elsewhere continues exactly (default); --no-deterministic allows faster "
                             "kernels that are not (AMX prefill attention on CPUs that have AMX)")
    parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                             'or \'{"model": DRAFT, "num_speculative_tokens": 3}\' (docs/speculative_decoding.md)')
    par = parser.add_argument_group("parallelism (see docs/parallelism.md)")
    par.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel ranks")
    par.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1, help="pipeline stages")
    par.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=1, help="expert-parallel ranks (MoE)")
    par.add_argument("--num-micro-batches", type=int, default=None, help="pipeline micro-batches per step (default: pp)")
    par.add_argument("--pp-partition", default=None, help="layers per stage, comma-separated, e.g. 10,14")
    par.add_argument("--num-redundant-experts", type=int, default=0,
                     help="extra expert slots per EP rank, for replicas of hot experts")
    par.add_argument("--nnodes", type=int, default=1, help="hosts of this replica (without torchrun)")
    par.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 .. nnodes-1")
    par.add_argument("--dist-init-addr", default=None, help="HOST:PORT of node 0, where the ranks meet")
    par.add_argument("--comm-timeout", type=float, default=20.0,
                     help="seconds a silent peer rank is waited for before the replica gives up")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=args.seed,
        kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        generation_config=args.generation_config, skip_tokenizer_init=args.skip_tokenizer_init, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=(SchedulerConfig.max_num_batched_tokens if args.max_num_batched_tokens is None
                                else args.max_num_batched_tokens),
        enable_prefix_caching=not args.no_prefix_caching, prefault_kv_cache=bool(args.prefault_kv_cache),
        tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, num_micro_batches=args.num_micro_batches,
        pp_layer_partition=_int_list(args.pp_partition, "--pp-partition"),
        num_redundant_experts=args.num_redundant_experts,
        nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
        comm_timeout_s=args.comm_timeout, cpu_threads=args.cpu_threads, enforce_eager=args.enforce_eager,
        quantization=args.quantization, deterministic=args.deterministic,
        speculative_config=args.speculative_config,
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    from shardserve.config import ConfigError

    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
