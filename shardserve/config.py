"""Frozen configuration dataclasses shared by the engine, planner and simulator.

Each config is resolved once (from a checkpoint, CLI flags or a file) and passed explicitly;
derive variants with `dataclasses.replace`, never by mutation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shardserve import param_counts
from shardserve.parallel_config import ParallelConfig  # re-exported: the layout lives in its own module
from shardserve.server.protocol import PROGRESS_INTERVAL_S

# HF `architectures[0]` -> our family name. Families share one model implementation.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Architectures the planner can size (shapes only: `from_hf_config(..., shapes_only=True)`) but
# the engine has no implementation of: MLA attention, Llama 4's interleaved MoE.
PLANNER_ONLY_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Llama4ForConditionalGeneration": "llama4",
    "Llama4ForCausalLM": "llama4",
}


class ConfigError(ValueError):
    """A configuration or checkpoint that cannot be served; the message says why."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "default" or "llama3" (the variant Llama 3.1+ ships);
    "linear" divides positions by `factor`."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are cached as one compressed
    latent of `kv_lora_rank` plus a shared rotary key of `qk_rope_head_dim` per token and layer,
    up-projected per head (`qk_nope_head_dim` of key, `v_head_dim` of value) when attended;
    queries come through a `q_lora_rank` bottleneck (0: projected from the hidden state directly)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer, independent of where it was loaded from."""

    architecture: str  # family: a value of HF_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before rotary
    # Mixture of experts; num_experts == 0 means dense. An MoE layer replaces the MLP by a router
    # over `num_experts` gated experts of width `moe_intermediate_size`, of which each token uses
    # the top `num_experts_per_token`, plus (when its width is > 0) an always-on shared expert.
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # rescale the top-k router probabilities to sum to 1
    dense_layer_ids: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP
    mla: MlaShape | None = None  # latent attention instead of per-head K and V (planner only)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.is_moe and layer_id not in self.dense_layer_ids

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied; every expert counted)."""
        moe_mlp = (param_counts.router_params(self) + self.num_experts * param_counts.expert_params(self)
                   + param_counts.shared_expert_params(self) + param_counts.shared_expert_gate_params(self))
        num_moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        mlp = num_moe_layers * moe_mlp + (self.num_layers - num_moe_layers) * param_counts.dense_mlp_params(self)
        per_layer = param_counts.attention_params(self) + param_counts.layer_norm_params(self)
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlp + embed + self.hidden_size

    def active_params_per_layer(self) -> list[int]:
        """Weights one token multiplies by in each layer (its top-k experts, not all of them):
        the per-layer cost a pipeline split balances. The shared expert's gate (one hidden-size
        vector; the cost model's FLOPs count it) is left out: negligible, yet counting it could
        move the split of a model already deployed."""
        attention = param_counts.attention_params(self)
        dense = attention + param_counts.dense_mlp_params(self)
        routed = self.num_experts_per_token * param_counts.expert_params(self)
        moe = attention + param_counts.router_params(self) + routed + param_counts.shared_expert_params(self)
        return [moe if self.is_moe_layer(i) else dense for i in range(self.num_layers)]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * param_counts.kv_values_per_token(self) * dtype_bytes

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], shapes_only: bool = False) -> "ModelConfig":
        """Build from a parsed Hugging Face `config.json`. `shapes_only` (the planner) also
        accepts PLANNER_ONLY_ARCHITECTURES and rope scalings the engine does not implement: the
        result has the right sizes for counting, not what the engine needs to run it."""
        archs = hf.get("architectures") or []
        known = {**HF_ARCHITECTURES, **PLANNER_ONLY_ARCHITECTURES} if shapes_only else HF_ARCHITECTURES
        arch = next((known[a] for a in archs if a in known), None)
        if arch is None:
            supported = ", ".join(sorted(HF_ARCHITECTURES))
            planned = next((a for a in archs if a in PLANNER_ONLY_ARCHITECTURES), None)
            why = f" (`shardserve plan` can size {planned}; the engine cannot serve it)" if planned else ""
            raise ConfigError(f"unsupported architecture {archs or hf.get('model_type')!r}{why}; "
                              f"supported: {supported}")
        if arch == "llama4":  # a multimodal config: the language model's shape is its text_config
            hf = {**hf["text_config"], "architectures": archs}
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size_mlp" if arch == "llama4" else "intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=_head_dim(hf, num_heads),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf, shapes_only),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(arch, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            mla=_mla_shape(hf) if arch.startswith("deepseek") else None,
            **_moe_fields(arch, hf),
        )


def _head_dim(hf: dict[str, Any], num_heads: int) -> int:
    if "kv_lora_rank" in hf:  # MLA: a query/key head is its no-rope part plus its rotary part
        return hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    return hf.get("head_dim") or hf["hidden_size"] // num_heads


def _mla_shape(hf: dict[str, Any]) -> MlaShape:
    return MlaShape(kv_lora_rank=hf["kv_lora_rank"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"],
                    q_lora_rank=hf.get("q_lora_rank") or 0)


def _attention_bias(arch: str, hf: dict[str, Any]) -> bool:
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":  # older Qwen1.5-MoE configs predate the `qkv_bias` key but have biases
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _moe_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ModelConfig for the MoE families; {} (dense) for the others.
    Defaults are transformers' own where a config.json may omit the key."""
    if arch == "mixtral":  # every layer sparse; `intermediate_size` is the expert width
        return dict(num_experts=hf["num_local_experts"], num_experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    num_layers = hf["num_hidden_layers"]
    if arch.startswith("deepseek"):  # the first k layers dense, then every moe_layer_freq-th sparse
        first_k, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        dense = tuple(i for i in range(num_layers) if i < first_k or i % freq)
        return dict(num_experts=hf["n_routed_experts"], num_experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layer_ids=dense)
    if arch == "llama4":  # experts and the shared expert are `intermediate_size` wide; dense MLPs wider
        step = hf.get("interleave_moe_layer_step", 1)
        sparse = set(hf.get("moe_layers") or range(step - 1, num_layers, step))
        return dict(num_experts=hf["num_local_experts"], num_experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"],
                    shared_expert_intermediate_size=hf["intermediate_size"], norm_topk_prob=False,
                    dense_layer_ids=tuple(i for i in range(num_layers) if i not in sparse))
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return {}
    # Layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    sparse_step = hf.get("decoder_sparse_step") or 1
    mlp_only = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in mlp_only or (i + 1) % sparse_step)
    # transformers >= 5 writes Qwen3-MoE's expert count as `num_local_experts`
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    shared = hf.get("shared_expert_intermediate_size", 5632) if arch == "qwen2_moe" else 0
    return dict(num_experts=num_experts, num_experts_per_token=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], shared_expert_intermediate_size=shared,
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), dense_layer_ids=dense)


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any], shapes_only: bool = False) -> RopeScaling:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_scaling`.
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default" or (shapes_only and kind not in ("llama3", "linear")):  # e.g. yarn: no size effect
        return RopeScaling()
    if kind not in ("llama3", "linear"):
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    return RopeScaling(
        kind=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. The pool holds `kv_cache_memory_bytes` when set, otherwise
    `kv_cache_memory_fraction` of the memory free after loading the weights (default: 0.85 of
    free GPU memory, 0.1 of free host memory, since on CPU the pool shares RAM with everything)."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    # CPU: commit every page of the pool when it is allocated, rather than as blocks are first
    # written (a fresh engine's first requests then pay the page faults: a 1,024-token prefill
    # took 383 ms instead of 324 on a 2-core VM, where a fault costs more than the zeroing).
    # `serve` turns it on, as a server holds its budget anyway; tests and scripts that start
    # many small engines leave it off (1 GiB takes about 0.7 s to commit here).
    prefault_kv_cache: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # Largest chunk of one prompt per step; smaller values interleave prefill with decodes.
    max_prefill_chunk_tokens: int | None = None


def serving_token_budget(on_cpu: bool) -> int:
    """A server's max_num_batched_tokens where none is given. Every prompt admitted in a step
    waits for the whole step: on a CPU a 2,048-token prefill step takes most of a second
    (SmolLM2-135M bf16, 2 Sapphire Rapids cores: ~0.7 s), so a wave of prompts is better served
    a few at a time. 512 there cut the TTFT p50 of closed-loop waves of 8 and 32 prompts by 28%
    and 53% for 2% of throughput (256: 41% and 61% for 4%, and the mixed workload's TPOT 6% worse;
    2026-12-03). Offline runs keep SchedulerConfig's 2,048, as GPUs do (vLLM's server default)."""
    return 512 if on_cpu else SchedulerConfig.max_num_batched_tokens


# SpeculativeConfig.method: engine/ngram_proposer.py, engine/draft_proposer.py
SPECULATIVE_METHODS = ("ngram", "draft_model")


# EngineConfig.quantization: layers/quantization.py (fp8, int8), layers/block_quant.py (gguf), none
QUANTIZATION_METHODS = ("fp8", "int8", "gguf", "none")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each decoding request may carry up to
    `num_speculative_tokens` proposed tokens, verified by the target model in the same step.
    "ngram" proposes the tokens that followed the latest earlier occurrence of the request's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens (prompt lookup); "draft_model" (implied by
    `model`) the greedy guesses of a smaller model that shares the target's tokenizer. Whether a
    step speculates, and how far, is the policy's call (engine/speculation_policy.py);
    `disable_by_batch_size` also switches it off at that many running requests, as in vLLM."""

    method: str | None = None  # None: "draft_model" with a `model`, else "ngram"
    model: str | None = None  # the draft: an HF folder, a .gguf file or an embedded name
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    # "auto": speculate only when the measured acceptance and step costs say it pays;
    # "always": every step that has proposals (for tests and measurements)
    policy: str = "auto"
    # the draft's weights (EngineConfig.quantization), e.g. "gguf": a quantized copy of the target
    # as its own cheaper draft
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ConfigError(f"unknown draft quantization {self.quantization!r}; choose one of "
                              f"{', '.join(QUANTIZATION_METHODS)}")
        if self.quantization is not None and self.model is None:
            raise ConfigError("speculative `quantization` is the draft model's: it needs a draft `model`")
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; choose one of "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative method draft_model takes a draft `model`, and only it does")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.policy not in ("auto", "always"):
            raise ConfigError(f"speculative policy must be 'auto' or 'always', got {self.policy!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        """vLLM's --speculative-config JSON object; unknown keys are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, resolved. `model` is a path or an embedded model name."""

    model: str = "smollm2"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # defaults to the model's context window
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    show_progress: bool = True
    # CPU threads for the forward pass: None picks, step by step, the fastest of all the threads
    # torch has, half of them and one (engine/thread_governor.py); a number fixes it
    cpu_threads: int | None = None
    # where requests that leave sampling fields out take them from: "auto", the model's own
    # (generation_config.json; models/sampling_defaults.py), or "vllm", SamplingParams' defaults
    generation_config: str = "auto"
    # no tokenizer (vLLM's skip_tokenizer_init): prompts come as token ids, outputs carry ids only
    skip_tokenizer_init: bool = False
    # GPU: run every step eagerly, no CUDA graphs for decode steps (engine/cuda_graphs.py)
    enforce_eager: bool = False
    # the linear weights quantized after loading: "fp8", "int8" (layers/quantization.py); kept in a
    # GGUF's own blocks: "gguf" (block_quant.py), what None means for a .gguf on a CPU (vLLM's rule:
    # model_loader.quantization_for); "none": a GGUF dequantized to `dtype`
    quantization: str | None = None
    # kernels whose result for a token does not depend on its batch nor on whether prefill or
    # decode computed it (a resumed stream continues exactly); False also allows faster ones
    # that are not (the AMX prefill attention tiles: csrc/paged_prefill_attention.cpp)
    deterministic: bool = True
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose one of "
                              f"{', '.join(QUANTIZATION_METHODS)}")
        if self.parallel.dp_attention:
            raise ConfigError("dp_attention is a layout `shardserve plan` prices; the engine does not run it")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end of one replica."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # defaults to the --model value
    max_waiting_requests: int = 256  # beyond this many unscheduled requests, answer 429
    # a larger body is answered 413 unread; a full 128k-token prompt as JSON ids is about 1 MiB
    max_request_bytes: int = 8 << 20
    ssl_keyfile: str | None = None  # both set: HTTPS (uvicorn's TLS)
    ssl_certfile: str | None = None
    log_level: str = "info"
    tool_call_parser: str = "hermes"  # how tool calls are written: hermes | llama3_json | mistral
    # live efficiency metrics: the profiler's calibration file (device peaks) and the device price
    calibration: str | None = None
    device_price_per_hour_usd: float | None = None  # default: the calibration's hardware price, else 0


@dataclass(frozen=True)
class RouterConfig:
    """The gateway in front of a fleet of replicas (shardserve/router/)."""

    replicas: tuple[str, ...] = ()  # base URLs, e.g. http://10.0.0.5:8000
    policy: str = "least_outstanding"  # round_robin | least_outstanding | power_of_two | prefix_aware
    host: str = "127.0.0.1"
    port: int = 8080
    # a replica with this many requests in flight through the router is saturated
    max_outstanding_per_replica: int = 64
    # batch-class requests are admitted only while the fleet is below this share of its capacity
    batch_capacity_fraction: float = 0.5
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 5.0  # generous: a busy replica is slow to answer, not dead
    eject_after_failures: int = 3  # consecutive failed requests or probes
    eject_base_s: float = 2.0  # first ejection; doubles on each failed half-open probe
    eject_max_s: float = 30.0
    # a stream with no event and no progress comment (replicas send one a second while their
    # engine runs, also for a request still queued) for this long: the replica stalled
    stall_timeout_s: float = 10.0
    # a non-streamed request's answer; a resumed stream's wait for a replica with room
    first_token_timeout_s: float = 120.0
    max_attempts: int = 4  # replicas one request may try (first try, retries and resumes)
    prefix_chars: int = 256  # prefix-aware routing keys on this much of the prompt
    prefix_load_slack: float = 1.25  # ... unless its replica is this much above the mean load
    max_request_bytes: int = 8 << 20  # as ServerConfig's
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_outstanding_per_replica < 1:
            raise ConfigError("max_attempts and max_outstanding_per_replica must be at least 1")
        if self.stall_timeout_s <= 2 * PROGRESS_INTERVAL_S:
            raise ConfigError(f"stall_timeout_s must be above {2 * PROGRESS_INTERVAL_S:g} s: replicas send progress "
                              f"every {PROGRESS_INTERVAL_S:g} s")
