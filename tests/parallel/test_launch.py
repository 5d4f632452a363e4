"""Joining the ranks: start-up is not held to --comm-timeout, collectives are."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.config import EngineConfig, ParallelConfig
from shardserve.parallel import launch


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
