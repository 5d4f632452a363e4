"""Start one replica: load the engine, run its step loop, serve the API with uvicorn."""
from __future__ import annotations

import contextlib
import logging

import uvicorn

from shardserve.config import EngineConfig, ServerConfig
from shardserve.engine.engine import LLMEngine
from shardserve.server.api import build_app
from shardserve.server.async_engine import AsyncEngine
from shardserve.server.metrics import ServerMetrics


def build_server(engine_config: EngineConfig, server_config: ServerConfig):
    """The FastAPI app and its AsyncEngine (started and stopped by the app's lifespan)."""
    engine = LLMEngine(engine_config)
    model_name = server_config.served_model_name or engine_config.model
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, server_config.max_waiting_requests, on_step=metrics.observe_step)
    info = {"dtype": engine_config.dtype, "device": engine_config.device}
    app = build_app(async_engine, metrics, model_name, info)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async_engine.start()
        yield
        async_engine.shutdown()

    app.router.lifespan_context = lifespan
    return app, async_engine


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, _ = build_server(engine_config, server_config)
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=server_config.log_level,
                timeout_graceful_shutdown=5)
