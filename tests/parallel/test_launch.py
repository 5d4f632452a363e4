"""Joining the ranks: start-up is not held to --comm-timeout, collectives are, in every group."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.config import EngineConfig, ParallelConfig
from shardserve.parallel import launch
from shardserve.parallel.groups import ParallelGroups


def test_ranks_may_take_longer_to_join_than_the_comm_timeout(monkeypatch):
    """A short --comm-timeout (a hung peer is caught fast) must not fail a start-up on a busy
    host, where spawning a rank and importing torch take longer than it: the join waits
    JOIN_TIMEOUT_S, and the group's collectives get the comm timeout once every rank is in."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its own
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", kw["timeout"])))
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda timeout: calls.append(("set", timeout)))
    config = EngineConfig(model="unused", parallel=ParallelConfig(tp_size=2, comm_timeout_s=6.0))
    launch._init_process_group(config, 0, "tcp://127.0.0.1:1", 2)
    assert calls == [("init", timedelta(seconds=launch.JOIN_TIMEOUT_S)), ("set", timedelta(seconds=6))]
    # a comm timeout longer than the join's holds for both
    calls.clear()
    config = EngineConfig(model="unused", parallel=ParallelConfig(tp_size=2, comm_timeout_s=600.0))
    launch._init_process_group(config, 0, "tcp://127.0.0.1:1", 2)
    assert calls == [("init", timedelta(seconds=600)), ("set", timedelta(seconds=600))]


def test_every_group_gets_the_comm_timeout(monkeypatch):
    """torch gives a new group its own default timeout (30 minutes for gloo), not the world
    group's: without passing it on, a peer hung inside a tp or ep collective would go unnoticed
    for half an hour instead of --comm-timeout."""
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append((ranks, kw)) or object())
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # so the gloo control group is made too
    ParallelGroups.build(ParallelConfig(tp_size=2, pp_size=2, comm_timeout_s=6.0), rank=0)
    assert [ranks for ranks, _ in made] == [[0, 1], [2, 3], None]
    assert all(kw["timeout"] == timedelta(seconds=6) for _, kw in made)
