"""Start the ranks of one replica and join them with torch.distributed.

    one host:             shardserve serve --tp 2 --pp 2      this process is rank 0 and spawns
                                                              ranks 1-3 (torch.multiprocessing)
    hosts, torchrun:      torchrun --nnodes 2 --node-rank R --master-addr A --nproc-per-node 2 \\
                              -m shardserve.cli serve --tp 2 --pp 2
    hosts, no torchrun:   shardserve serve --tp 2 --pp 2 --nnodes 2 --node-rank R --dist-init-addr A:P
                          (each host spawns its world_size / nnodes ranks)

Rank 0 is the driver (scheduler, HTTP); every other rank runs the `worker_main` it is given (the
engine's worker loop, engine/launcher.py) until the driver says Shutdown. A spawned rank dies with its parent (PR_SET_PDEATHSIG), so killing the driver
never leaves workers behind.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from shardserve.config import ConfigError, EngineConfig, ParallelConfig
from shardserve.parallel.groups import ParallelGroups
from shardserve.ports import free_port

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 120.0  # how long the ranks (and the hosts of --nnodes) may take to find each other at start


@dataclass
class Ranks:
    """This process's place in the replica, and the local ranks it spawned."""

    groups: ParallelGroups
    children: mp.ProcessContext | None = None

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the spawned ranks to exit (after Shutdown), killing any that do not."""
        if self.children is not None:
            for process in self.children.processes:
                process.join(timeout_s)
                if process.is_alive():
                    process.kill()
                    process.join()
            self.children = None
        if dist.is_initialized():
            dist.destroy_process_group()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


WorkerMain = Callable[[EngineConfig, ParallelGroups], None]  # a non-driver rank's life: load, serve


def start_ranks(config: EngineConfig, worker_main: WorkerMain) -> Ranks:
    """Make this process a rank of the replica `config.parallel` describes, spawning this host's
    other ranks (each runs `worker_main`, a module-level function) unless torchrun already
    started them. Raises ConfigError for a launch that
    cannot work (a world size that torchrun or --nnodes contradicts, no --dist-init-addr)."""
    par = config.parallel
    if under_torchrun():
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world_size != par.world_size:
            raise ConfigError(f"torchrun started {world_size} processes but this layout needs "
                              f"{par.world_size} (pp x max(tp, ep))")
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        _init_process_group(config, rank, "env://", local_size)
        return Ranks(ParallelGroups.build(par, rank))
    local_size = ranks_per_node(par)
    first_rank = par.node_rank * local_size
    if par.dist_init_addr is None and par.nnodes > 1:
        raise ConfigError("with --nnodes > 1, give every node --dist-init-addr HOST:PORT of node 0")
    init_method = f"tcp://{par.dist_init_addr or f'127.0.0.1:{free_port()}'}"
    children = None
    if local_size > 1:
        children = mp.start_processes(_spawned_rank_main,
                                      args=(config, worker_main, first_rank, init_method, local_size, os.getpid()),
                                      nprocs=local_size - 1, join=False, start_method="spawn")
    try:
        _init_process_group(config, first_rank, init_method, local_size)
    except BaseException:
        Ranks(ParallelGroups.single(), children).close(timeout_s=0)
        raise
    return Ranks(ParallelGroups.build(par, first_rank), children)


def ranks_per_node(par: ParallelConfig) -> int:
    if par.nnodes < 1 or not 0 <= par.node_rank < par.nnodes:
        raise ConfigError(f"--node-rank {par.node_rank} must be in [0, --nnodes {par.nnodes})")
    if par.world_size % par.nnodes:
        raise ConfigError(f"{par.world_size} ranks do not split evenly over {par.nnodes} nodes")
    return par.world_size // par.nnodes


def serve_worker_and_exit(config: EngineConfig, ranks: Ranks, worker_main: WorkerMain) -> None:
    """For a non-driver rank running the user's command (under torchrun, or on a host with
    --node-rank > 0): serve, wait for the ranks it spawned, exit."""
    try:
        worker_main(config, ranks.groups)
        if ranks.children is not None:
            for process in ranks.children.processes:
                process.join(config.parallel.comm_timeout_s)
    except BaseException as exc:  # noqa: BLE001
        worker_exit(ranks.groups.rank, exc)
    worker_exit(ranks.groups.rank, None)


def worker_exit(rank: int, exc: BaseException | None) -> None:
    """Leave a worker process now: 0 after a clean Shutdown, 1 after an error (one line on
    stderr). os._exit, because tearing down a process group whose peers died can block."""
    if exc is None:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)
    print(f"shardserve rank {rank}: exiting: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
          file=sys.stderr, flush=True)
    os._exit(1)


def _spawned_rank_main(index: int, config: EngineConfig, worker_main: WorkerMain, first_rank: int, init_method: str,
                       local_size: int, parent_pid: int) -> None:
    rank = first_rank + 1 + index
    _die_with_parent(parent_pid)
    # tqdm's default lock is a multiprocessing semaphore that os._exit would leak (and the
    # resource tracker would warn about); a worker shows no progress bars anyway
    tqdm.set_lock(threading.RLock())
    try:
        _init_process_group(config, rank, init_method, local_size)
        worker_main(config, ParallelGroups.build(config.parallel, rank))
    except BaseException as exc:  # noqa: BLE001 - every failure ends this process with a message
        worker_exit(rank, exc)
    worker_exit(rank, None)


def _init_process_group(config: EngineConfig, rank: int, init_method: str, local_size: int) -> None:
    # ranks on one host share its cores; oversubscribed OpenMP pools slow every rank down
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % local_size)
    # Joining waits for every rank to start (spawn, import torch: many seconds on a busy host);
    # --comm-timeout is for a peer that stops answering once running, so it is set after.
    comm_timeout = timedelta(seconds=config.parallel.comm_timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.parallel.world_size,
                            timeout=max(comm_timeout, timedelta(seconds=JOIN_TIMEOUT_S)))
    dist.distributed_c10d._set_pg_timeout(comm_timeout)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died while this process started: no signal will come
            os._exit(1)

