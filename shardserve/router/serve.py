"""Run the router with uvicorn."""
from __future__ import annotations

import logging

import uvicorn

from shardserve.config import RouterConfig
from shardserve.router.app import build_router_app
from shardserve.server.auth import AuthConfig


def run_router(config: RouterConfig, auth: AuthConfig = AuthConfig()) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, _ = build_router_app(config, auth)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5,
                ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
    return 0
