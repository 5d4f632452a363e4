"""How one replica is split over processes: ParallelConfig, the layout the engine builds and the
planner prices (re-exported by shardserve.config, where the other configs live)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """How one replica is split over processes (ranks).

    Ranks are grouped by pipeline stage; a stage has `stage_size = max(tp_size, ep_size)` ranks:

        rank = pp_rank * stage_size + local_rank
        attention and dense MLPs: tensor parallel over consecutive runs of tp_size ranks
        experts (ep_size > 1): spread over all stage_size ranks of the stage, each expert whole

    so tp=2, ep=2 puts attention TP and expert EP on the same two ranks, and tp=1, ep=2 repeats
    attention on both ranks while the experts are split between them.
    """

    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    num_micro_batches: int | None = None  # pipeline micro-batches per step; default pp_size
    # layers per stage; default: as even as possible (the first stages take the remainder)
    pp_layer_partition: tuple[int, ...] | None = None
    num_redundant_experts: int = 0  # extra expert slots per EP rank, for hot-expert replicas
    # Data-parallel attention (ep > tp, as SGLang and vLLM run DeepSeek): the stage's
    # stage_size / tp attention groups each serve their own share of the sequences and hold only
    # their KV, instead of repeating one attention; the experts stay spread over every rank. The
    # planner prices this layout; the engine does not run it (EngineConfig refuses it).
    dp_attention: bool = False
    comm_timeout_s: float = 20.0  # a peer silent this long is taken for dead
    # Several hosts without torchrun: every host runs the same command with its --node-rank;
    # each starts world_size / nnodes ranks and finds the others at node 0's host:port.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    @property
    def stage_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.stage_size

    @property
    def attention_groups(self) -> int:
        """Groups of tp ranks that attend to different sequences: stage_size / tp under
        dp_attention, else 1 (the ranks beyond tp repeat the same attention)."""
        return self.stage_size // self.tp_size if self.dp_attention else 1

    def validate(self, model: "ModelConfig") -> None:
        """Raise ConfigError, in one sentence, unless this layout can split `model`."""
        from shardserve.config import ConfigError  # config re-exports this module: import late
        for name in ("tp_size", "pp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.split('_')[0]}={getattr(self, name)} must be at least 1")
        tp, pp, ep = self.tp_size, self.pp_size, self.ep_size
        if model.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the model's {model.num_heads} attention heads")
        kv = model.num_kv_heads
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise ConfigError(f"tp={tp} can neither split nor evenly replicate the model's {kv} KV heads")
        if pp > model.num_layers:
            raise ConfigError(f"pp={pp} exceeds the model's {model.num_layers} layers")
        if self.pp_layer_partition is not None and (
                len(self.pp_layer_partition) != pp or sum(self.pp_layer_partition) != model.num_layers
                or min(self.pp_layer_partition) < 1):
            raise ConfigError(f"the layer partition {list(self.pp_layer_partition)} must give each of the "
                              f"{pp} stages at least one layer and sum to {model.num_layers}")
        num_experts = getattr(model, "num_experts", 0)
        if ep > 1 and not num_experts:
            raise ConfigError(f"ep={ep} needs a mixture-of-experts model; this one is dense")
        if num_experts and num_experts % ep:
            raise ConfigError(f"ep={ep} does not divide the model's {num_experts} experts")
        if ep > 1 and ep % tp:
            raise ConfigError(f"tp={tp} must divide ep={ep}: experts are spread over all ranks of a stage")
        if self.dp_attention and ep <= tp:
            raise ConfigError(f"dp_attention needs ep > tp (attention groups of tp ranks within ep ranks), "
                              f"got tp={tp} ep={ep}")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ConfigError(f"num_micro_batches={self.num_micro_batches} must be at least 1")

    def model_stages(self, model: ModelConfig) -> list[range]:
        """The global layer ids each pipeline stage of `model` runs: the one split the engine
        builds and the planner prices. Layers cost the weights one token multiplies by; the LM
        head rides on the last stage and runs on one row per sequence per step, layers on every
        token: with prompts twice as long as outputs that is a third of the rows (measured on
        benchmarks/parallel_scaling.py: stage compute 15.4 vs 15.6 ms; at full weight 20.5 vs 10.0)."""
        head_cost = model.vocab_size * model.hidden_size / 3
        return self.stage_layers(model.active_params_per_layer(), head_cost)

    def stage_layers(self, layer_costs: list[float], last_stage_cost: float = 0.0) -> list[range]:
        """The global layer ids each pipeline stage runs: `pp_layer_partition` if given, else
        the contiguous split that minimises the most expensive stage, where a stage costs the
        sum of its `layer_costs` (plus `last_stage_cost` for the last: the LM head)."""
        counts = self.pp_layer_partition or _balanced_split(layer_costs, self.pp_size, last_stage_cost)
        starts = [sum(counts[:s]) for s in range(self.pp_size)]
        return [range(start, start + count) for start, count in zip(starts, counts)]


def _balanced_split(costs: list[float], num_parts: int, last_extra: float) -> list[int]:
    """Sizes of `num_parts` non-empty contiguous runs of `costs` minimising the largest run's
    sum (the last run also carries `last_extra`); among equals, the earliest cuts.
    best[p][i]: the best largest sum for the first i costs in p runs."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for p in range(1, num_parts + 1):
        extra = last_extra if p == num_parts else 0.0
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    sizes, i = [], n
    for p in range(num_parts, 0, -1):
        sizes.append(i - cut[p][i])
        i = cut[p][i]
    return sizes[::-1]
