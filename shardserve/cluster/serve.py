"""Run a cluster in one process: the router's app (with the cluster's admin endpoints) on
uvicorn, and the supervisor's loop beside it on the same event loop. On SIGTERM or SIGINT the
router stops taking requests, then every replica is stopped before the process exits."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from pathlib import Path

import uvicorn

from shardserve.cluster.admin import add_cluster_routes
from shardserve.cluster.config import ClusterConfig, check_layout
from shardserve.cluster.supervisor import Supervisor
from shardserve.router.app import build_router_app
from shardserve.server.auth import AuthConfig

log = logging.getLogger(__name__)


def run_cluster(config: ClusterConfig, auth: AuthConfig = AuthConfig()) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. A group whose layout cannot split its
    model raises ConfigError before anything starts."""
    logging.basicConfig(level=config.router.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe
    for group in config.groups:
        check_layout(group.model, group.layout)
    log_dir = Path(config.supervisor.log_dir or tempfile.mkdtemp(prefix="shardserve-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(auth.child_env())  # the replicas this process starts take the same keys
    return asyncio.run(_serve(config, log_dir, auth))


async def _serve(config: ClusterConfig, log_dir: Path, auth: AuthConfig) -> int:
    app, router = build_router_app(config.router, auth)
    supervisor = Supervisor(config, router, log_dir)
    add_cluster_routes(app, supervisor)
    server = uvicorn.Server(uvicorn.Config(app, host=config.router.host, port=config.router.port,
                                           log_level=config.router.log_level, access_log=False,
                                           timeout_graceful_shutdown=5, ssl_keyfile=config.router.ssl_keyfile,
                                           ssl_certfile=config.router.ssl_certfile))

    def request_exit(_signum, _frame) -> None:
        server.should_exit = True

    # uvicorn re-raises the SIGTERM/SIGINT it caught once it has stopped; with these handlers
    # in place that only repeats the request to exit, instead of killing this process before
    # it has stopped the replicas
    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    log.info("cluster: router on http://%s:%d, %s; replica logs in %s", config.router.host, config.router.port,
             ", ".join(f"{g.name}: {g.replicas} x {g.layout}" for g in config.groups), log_dir)
    supervising = asyncio.ensure_future(supervisor.run())
    try:
        await server.serve()
    finally:
        supervising.cancel()
        log.info("cluster: stopping %d replicas", len(supervisor.replicas))
        await supervisor.shutdown()
    return 0 if server.started else 1
