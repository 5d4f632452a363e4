"""Which batches the profiler runs. A sweep point is one batch shape, measured as the engine's
whole next step; three kinds cover what a serving step can be:

    prefill  `num_seqs` new prompts of `prompt_len` tokens each, whole in one step
    decode   `num_seqs` running sequences, one new token each, attending `context_len` tokens
    mixed    `num_seqs` decodes as above plus one new prompt of `prompt_len` tokens

The quick sweep finishes in well under a minute for SmolLM2 on a 2-core CPU; the full sweep
spreads batch sizes and lengths wider for a better calibration.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardserve.config import ConfigError

KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class SweepPoint:
    kind: str
    num_seqs: int
    prompt_len: int = 0
    context_len: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"sweep point kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.num_seqs < 1:
            raise ConfigError("a sweep point needs at least one sequence")
        if self.kind in ("prefill", "mixed") and self.prompt_len < 1:
            raise ConfigError(f"a {self.kind} point needs prompt_len >= 1")
        if self.kind in ("decode", "mixed") and self.context_len < 2:
            raise ConfigError(f"a {self.kind} point needs context_len >= 2 (a prompt token and the new one)")

    @property
    def num_step_tokens(self) -> int:
        """New tokens the measured step computes."""
        if self.kind == "prefill":
            return self.num_seqs * self.prompt_len
        return self.num_seqs + (self.prompt_len if self.kind == "mixed" else 0)

    @property
    def num_step_seqs(self) -> int:
        return self.num_seqs + (1 if self.kind == "mixed" else 0)

    @property
    def max_context_len(self) -> int:
        return max(self.prompt_len, self.context_len)

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.num_seqs}x{self.prompt_len}"
        decode = f"decode {self.num_seqs}@{self.context_len}"
        return decode if self.kind == "decode" else f"mixed {decode.split()[1]}+{self.prompt_len}"


@dataclass(frozen=True)
class SweepConfig:
    """The grid of a sweep, and how often each point runs: `num_warmup_steps` untimed, then
    `num_repeats` timed (the median counts), then one under torch.profiler for the split."""

    prefill: tuple[tuple[int, int], ...]  # (num_seqs, prompt_len)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...]  # (num_decodes, context_len, prompt_len)
    num_repeats: int = 3
    num_warmup_steps: int = 1

    def points(self, max_context_len: int | None = None) -> list[SweepPoint]:
        """The sweep's points, dropping those longer than `max_context_len` (the model's window
        less a few decode steps of room)."""
        points = [SweepPoint("prefill", b, prompt_len=n) for b, n in self.prefill]
        points += [SweepPoint("decode", b, context_len=c) for c in self.decode_contexts for b in self.decode_batches]
        points += [SweepPoint("mixed", b, prompt_len=n, context_len=c) for b, c, n in self.mixed]
        if max_context_len is not None:
            room = self.num_repeats + self.num_warmup_steps + 2
            points = [p for p in points if p.max_context_len + room <= max_context_len]
        if not points:
            raise ConfigError("the sweep has no point that fits the model's context window")
        return points


QUICK_SWEEP = SweepConfig(
    prefill=((1, 32), (1, 128), (1, 512), (4, 128)),
    decode_batches=(1, 4, 16, 32),
    decode_contexts=(64, 512),
    mixed=((8, 256, 64), (16, 128, 256)),
    num_repeats=3,
)

FULL_SWEEP = SweepConfig(
    prefill=((1, 16), (1, 64), (1, 256), (1, 1024), (1, 2048), (4, 64), (4, 256), (8, 128), (16, 64)),
    decode_batches=(1, 2, 4, 8, 16, 32, 64),
    decode_contexts=(32, 256, 1024),
    mixed=((4, 128, 64), (4, 512, 256), (16, 256, 128), (32, 128, 512), (64, 64, 32)),
    num_repeats=5,
)
