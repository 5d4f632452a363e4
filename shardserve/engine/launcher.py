"""Where a process learns which rank of its replica it is, and becomes it.

    single process     load the model, run it here: LLMEngine over a LocalExecutor
    parallel, rank 0   start (or join) the other ranks, load this rank's shard:
                       LLMEngine over a ParallelExecutor
    parallel, other    (under torchrun, or on a host with --node-rank > 0) load this rank's shard and
                       run the worker loop until the driver shuts down; the process then exits

Every command that builds an engine (`serve`, `generate`, `profile`, `LLM(...)`) calls
`build_engine`; ranks this process spawns run `run_worker` (shardserve/parallel/launch.py).
"""
from __future__ import annotations

import torch

from shardserve.config import EngineConfig
from shardserve.engine.cuda_graphs import decode_graphs
from shardserve.engine.draft_proposer import DraftProposer, load_draft
from shardserve.engine.engine import LLMEngine
from shardserve.engine.executor import LocalExecutor, ParallelExecutor, run_worker_loop
from shardserve.engine.model_loader import load_model
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.thread_governor import ThreadGovernor, ThreadPolicy, available_threads
from shardserve.engine.worker import Worker
from shardserve.models.checkpoint import load_checkpoint
from shardserve.parallel.groups import ParallelGroups
from shardserve.parallel.launch import serve_worker_and_exit, start_ranks


def build_engine(config: EngineConfig) -> LLMEngine:
    """This process's engine. On a parallel replica's non-driver rank this call serves as that
    rank until the driver shuts down, then exits the process: it does not return there."""
    if config.parallel.world_size == 1:
        loaded = load_model(config)
        graphs = decode_graphs(loaded, config.scheduler.max_num_seqs, config.enforce_eager)
        runner = ModelRunner.for_model(loaded, graphs, _draft(config, loaded))
        return LLMEngine(config, loaded, LocalExecutor(runner), thread_governor(config))
    # a bad path or an impossible layout fails here, in one line, before any rank starts
    config.parallel.validate(load_checkpoint(config.model).config)
    ranks = start_ranks(config, run_worker)
    if not ranks.groups.is_driver:
        serve_worker_and_exit(config, ranks, run_worker)
    try:
        loaded = load_model(config, ranks.groups)
        draft = _draft(config, loaded)  # whole, on the driver: it proposes once the step's tokens are known
    except BaseException:
        ranks.close()
        raise
    executor = ParallelExecutor(Worker(ModelRunner.for_model(loaded, draft=draft), ranks.groups), ranks)
    return LLMEngine(config, loaded, executor)


def _draft(config: EngineConfig, loaded) -> DraftProposer | None:
    spec = config.speculative
    return load_draft(config, loaded) if spec and spec.method == "draft_model" else None


def thread_governor(config: EngineConfig) -> ThreadGovernor | None:
    """A single CPU process's thread governor: adaptive, or fixed at `cpu_threads`. Parallel ranks
    keep the share of the cores parallel/launch.py gives each; a GPU's step does not depend on it."""
    if config.device != "cpu":
        return None
    if config.cpu_threads is not None:
        return ThreadGovernor(ThreadPolicy(config.cpu_threads, adaptive=False), torch.set_num_threads)
    return ThreadGovernor(ThreadPolicy(available_threads()), torch.set_num_threads)


def run_worker(config: EngineConfig, groups: ParallelGroups) -> None:
    """A non-driver rank: load its shard, then run steps until the driver shuts down."""
    loaded = load_model(config, groups)
    run_worker_loop(Worker(ModelRunner.for_model(loaded), groups))
