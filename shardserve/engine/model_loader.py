"""Builds everything the engine runs on from an EngineConfig: checkpoint, tokenizer, model with
its weights, and the KV-cache pool sized from the memory budget."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.config import ConfigError, EngineConfig, ModelConfig
from shardserve.dtypes import ENGINE_DTYPES
from shardserve.engine.grammar import Grammars
from shardserve.engine.heap import heap_for_loading, heap_for_serving
from shardserve.engine.kv_cache import KVCache, kv_budget_bytes
from shardserve.layers.attention.backend import AttentionBackend, attention_backend
from shardserve.layers.attention.paged_kv import KVShape
from shardserve.layers.cpu_kernels import build_all
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.registry import model_class
from shardserve.models.sampling_defaults import sampling_defaults
from shardserve.models.tokenizer import Tokenizer, load_tokenizer
from shardserve.parallel.comm import agree_on_min
from shardserve.parallel.groups import ParallelGroups

DTYPES = {name: getattr(torch, name) for name in ENGINE_DTYPES}  # the table: shardserve/dtypes.py


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None with skip_tokenizer_init
    kv_cache: KVCache
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    groups: ParallelGroups
    attention: AttentionBackend  # the model's attention backend; the runner builds its metadata
    sampling_defaults: dict[str, float]  # the model's, for what a request leaves out
    grammars: Grammars  # structured outputs over this model's vocabulary


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise ConfigError("float16 is GPU-only; use bfloat16 or float32 on CPU")
    return DTYPES[name]


def quantization_for(requested: str | None, checkpoint_format: str, device: torch.device) -> str | None:
    """What the layers' weights are kept in: `requested`, or for None what the checkpoint implies
    (as vLLM reads a .gguf: its blocks, where the CPU kernels take them; GPUs dequantize); "none"
    is the dtype itself."""
    if requested is None and checkpoint_format == "gguf" and device.type == "cpu":
        return "gguf"
    return None if requested == "none" else requested


def load_model(config: EngineConfig, groups: ParallelGroups | None = None, kv_num_blocks: int | None = None) -> LoadedModel:
    """Load this rank's share of the model (all of it in a single process) and its KV cache.
    In a parallel replica every rank calls this; the ranks agree on one number of KV blocks.
    `kv_num_blocks` sets the pool's size instead of the memory budget (a draft model's)."""
    groups = groups or ParallelGroups.single()
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    checkpoint = load_checkpoint(config.model)
    model_config = checkpoint.config
    if config.generation_config not in ("auto", "vllm"):
        raise ConfigError(f"--generation-config takes auto or vllm, not {config.generation_config!r}")
    defaults = sampling_defaults(config.model, checkpoint.path) if config.generation_config == "auto" else {}
    config.parallel.validate(model_config)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(checkpoint)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if device.type == "cpu":  # the native kernels, all at once, before the layers ask for them one by one
        build_all()
        heap_for_loading()  # before the checkpoint's reads (engine/heap.py)
    attention = attention_backend(device, deterministic=config.deterministic)
    with torch.device(device):
        model = model_class(model_config.architecture)(model_config, dtype, max_model_len, groups, attention)
    show_progress = config.show_progress and groups.is_driver
    quantization = quantization_for(config.quantization, checkpoint.format, device)
    if quantization == "gguf":
        if checkpoint.format != "gguf":
            raise ConfigError(f"--quantization gguf needs a .gguf checkpoint; {checkpoint.path} is an HF folder")
        if device.type != "cpu":
            raise ConfigError("--quantization gguf runs on CPU kernels; on a GPU serve the GGUF without it "
                              "(dequantized to --dtype) or use --quantization fp8")
        model.keep_checkpoint_blocks()
    model.load_weights(checkpoint.iter_lazy_tensors(show_progress=show_progress))
    model.prepack(quantization)
    model.eval()
    if device.type == "cpu":
        heap_for_serving()
    if kv_num_blocks is None:
        kv_cache = _allocate_kv_cache(config, model.kv_shape, max_model_len, dtype, device, groups)
    else:
        kv_cache = KVCache.allocate(model.kv_shape, kv_num_blocks, config.cache.block_size, dtype, device,
                                    prefault=config.cache.prefault_kv_cache)
    eos = tuple(dict.fromkeys(model_config.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
    grammars = Grammars(tokenizer, model_config.vocab_size, eos)
    return LoadedModel(model, model_config, tokenizer, kv_cache, max_model_len, eos, device, dtype, groups, attention,
                       defaults, grammars)


def _allocate_kv_cache(config: EngineConfig, shape: KVShape, max_model_len: int, dtype: torch.dtype,
                       device: torch.device, groups: ParallelGroups) -> KVCache:
    block_size = config.cache.block_size
    block_bytes = shape.block_bytes(block_size, dtype)
    num_blocks = kv_budget_bytes(config.cache, device) // block_bytes
    if groups.world_size > 1:  # the scheduler hands out block ids valid on every rank
        num_blocks = agree_on_min(num_blocks, groups.control)
    if num_blocks * block_size < max_model_len:
        need = -(-max_model_len // block_size) * block_bytes
        raise ConfigError(
            f"the KV cache holds {num_blocks * block_size} tokens, less than one full context of "
            f"{max_model_len}; give it at least {need} bytes (--kv-cache-memory) or lower --max-model-len")
    return KVCache.allocate(shape, num_blocks, block_size, dtype, device, prefault=config.cache.prefault_kv_cache)
