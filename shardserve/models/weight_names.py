"""How checkpoint tensor names map onto our parameters, declared as data per architecture.

A checkpoint name (HF layout; GGUF names are translated to it on reading) goes through:

    strip `prefix`  ->  skip it if it holds one of `ignored`  ->  apply `renames`
      ->  a part in `fused` becomes (our fused parameter, shard index): q/k/v -> qkv_proj 0/1/2

What depends on the rank (which stage's layers it holds, a tied head, expert slots) is the
model's business (decoder.py); what depends only on the architecture lives here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WeightNames:
    prefix: str = "model."
    ignored: tuple[str, ...] = ("rotary_emb",)  # buffers some checkpoints store; we recompute them
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint substring, ours)
    # (checkpoint sub-name, our fused parameter sub-name, shard index)
    fused: tuple[tuple[str, str, int], ...] = (
        ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
    )

    def canonical(self, name: str) -> str | None:
        """The checkpoint name in our spelling, unfused; None for a tensor we do not load."""
        name = name.removeprefix(self.prefix)
        if any(part in name for part in self.ignored):
            return None
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        return name

    def unfuse(self, name: str) -> tuple[str, int | None]:
        """(our parameter name, shard index within it; None: the whole parameter)."""
        for theirs, ours, shard in self.fused:
            if f".{theirs}." in name:
                return name.replace(theirs, ours), shard
        return name, None


LLAMA = WeightNames()
WEIGHT_NAMES = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "qwen2_moe": LLAMA, "qwen3_moe": LLAMA,
    "mixtral": replace(LLAMA, renames=((".block_sparse_moe.", ".mlp."),)),  # Mixtral's name for the MoE block
}
