"""Which ranks a process talks to, for each kind of parallelism: built once from a ParallelConfig
after `torch.distributed` is initialised, then passed to every layer that communicates.

Layout of world_size = pp x stage_size ranks (stage_size = max(tp, ep)), e.g. tp=2, pp=2:

    stage 0: ranks 0 1   <- one tp group; hidden states go rank 0 -> 2 and 1 -> 3
    stage 1: ranks 2 3   <- one tp group; the sampler is rank 2, its first rank

With ep > tp, a stage holds ep / tp tp groups that compute the same attention (tp=1, ep=2:
both ranks run attention on every token, and split the experts).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from shardserve.config import ParallelConfig


@dataclass
class CommStats:
    """Seconds this rank spent inside collectives and transfers (shared by all its groups)."""

    seconds: float = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


@dataclass(frozen=True)
class GroupInfo:
    """One process group as this rank sees it. `group` is None when size == 1 (no communication)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    ranks: tuple[int, ...] = (0,)  # global ranks, in group order
    stats: CommStats = field(default_factory=CommStats, compare=False)


@dataclass(frozen=True)
class ParallelGroups:
    config: ParallelConfig
    rank: int  # global
    tp: GroupInfo
    ep: GroupInfo  # the whole stage when ep > 1
    pp_rank: int
    control: dist.ProcessGroup | None  # gloo group over all ranks: step plans and sampled tokens
    stats: CommStats = field(default_factory=CommStats, compare=False)

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls(ParallelConfig(), 0, GroupInfo(), GroupInfo(), 0, None)

    @classmethod
    def build(cls, config: ParallelConfig, rank: int) -> "ParallelGroups":
        """Create the groups; every rank must call this, in the same order of calls (as
        `dist.new_group` requires), after `dist.init_process_group`."""
        stage_size, tp_size = config.stage_size, config.tp_size
        stats = CommStats()
        # a peer silent this long is dead, in every group (new groups would otherwise get torch's
        # default, 30 minutes for gloo)
        timeout = timedelta(seconds=config.comm_timeout_s)
        tp = ep = None
        for stage in range(config.pp_size):
            first = stage * stage_size
            for start in range(first, first + stage_size, tp_size):
                found = _new_group(tuple(range(start, start + tp_size)), rank, stats, timeout)
                tp = tp or found
            if config.ep_size > 1:
                found = _new_group(tuple(range(first, first + stage_size)), rank, stats, timeout)
                ep = ep or found
        control = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else dist.group.WORLD
        return cls(config, rank, tp or GroupInfo(stats=stats), ep or GroupInfo(stats=stats), rank // stage_size,
                   control, stats)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def pp_size(self) -> int:
        return self.config.pp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: the first rank of the last stage."""
        return (self.pp_size - 1) * self.config.stage_size

    @property
    def prev_stage_rank(self) -> int:
        """The rank in the previous stage with the same position in its stage."""
        return self.rank - self.config.stage_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.config.stage_size


def _new_group(ranks: tuple[int, ...], rank: int, stats: CommStats, timeout: timedelta) -> GroupInfo | None:
    """`dist.new_group(ranks)` (which every rank must call); this rank's view if it is a member."""
    group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
    if rank not in ranks:
        return None
    return GroupInfo(ranks.index(rank), len(ranks), group, ranks, stats)
