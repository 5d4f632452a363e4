"""Start one replica: load the engine, run its step loop, serve the API with uvicorn."""
from __future__ import annotations

import gc
import logging
import signal
import threading

import uvicorn

from shardserve.config import ConfigError, EngineConfig, ServerConfig
from shardserve.engine.launcher import build_engine
from shardserve.server.api import build_app
from shardserve.server.async_engine import AsyncEngine
from shardserve.server.auth import AuthConfig, AuthMiddleware
from shardserve.server.efficiency_metrics import efficiency_config, replica_hardware
from shardserve.server.limits import BodyLimitMiddleware
from shardserve.server.metrics import ServerMetrics
from shardserve.server.tool_calls import tool_format


def build_server(engine_config: EngineConfig, server_config: ServerConfig, auth: AuthConfig = AuthConfig()):
    """The FastAPI app (behind `auth`'s keys) and its AsyncEngine (not started)."""
    try:
        tool_format(server_config.tool_call_parser)  # before minutes of loading, not after
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    hardware = replica_hardware(engine_config, server_config.calibration)  # before the model's memory is taken
    engine = build_engine(engine_config)
    engine.warm_up()  # before the port opens: /health answers only once the kernels have run
    model_name = server_config.served_model_name or engine_config.model
    efficiency = efficiency_config(engine_config, engine.model_config, hardware, server_config.device_price_per_hour_usd,
                                   engine.weight_bytes_per_param())
    spec = engine_config.speculative
    metrics = ServerMetrics(model_name, efficiency, spec.num_speculative_tokens if spec else 0)
    async_engine = AsyncEngine(engine, server_config.max_waiting_requests, on_step=metrics.observe_step)
    par = engine_config.parallel
    info = {"dtype": engine_config.dtype, "device": engine_config.device,
            "layout": {"tp": par.tp_size, "pp": par.pp_size, "ep": par.ep_size, "world_size": par.world_size}}
    app = build_app(async_engine, metrics, model_name, info, server_config.tool_call_parser)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_request_bytes)
    app.add_middleware(AuthMiddleware, config=auth)  # outermost: no key, nothing read
    return app, async_engine


def run_server(engine_config: EngineConfig, server_config: ServerConfig, auth: AuthConfig = AuthConfig()) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code. The engine loop owns the main thread
    (see async_engine.py); uvicorn runs on a second thread. If a single-process engine dies, HTTP
    stays up and answers 503. If a parallel replica loses a rank, the in-flight requests get
    their error, and the server exits with 1 so that a supervisor restarts the replica."""
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, async_engine = build_server(engine_config, server_config, auth)
    # The model, tokenizer and app live as long as the process: take their objects (about 190k for
    # SmolLM2) out of the cyclic collector's reach. Otherwise each full collection walks them all
    # and stalls the engine loop for about 100 ms, at random, in the middle of serving.
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level=server_config.log_level, timeout_graceful_shutdown=5,
                                           ssl_keyfile=server_config.ssl_keyfile,
                                           ssl_certfile=server_config.ssl_certfile))
    stopping = threading.Event()

    def stop(_signum, _frame):
        stopping.set()
        async_engine.stop()
        server.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    http_failed = threading.Event()

    def serve_http() -> None:
        try:
            server.run()
        finally:
            if not stopping.is_set():  # uvicorn gave up (its port taken, say): no API, no replica
                http_failed.set()
                async_engine.stop()

    http = threading.Thread(target=serve_http, name="http", daemon=True)
    http.start()
    async_engine.run_forever()
    parallel = engine_config.parallel.world_size > 1
    if async_engine.error is not None and parallel:
        logging.getLogger(__name__).error("lost a rank of this replica (%s); exiting", async_engine.error)
        stopping.wait(1.0)  # let the handlers send the failed requests' errors
    while not parallel and not stopping.is_set() and http.is_alive():  # keep answering 503 until told to stop
        stopping.wait(0.5)
    stopping.set()  # from here on, the HTTP server stops because it is told to
    server.should_exit = True
    http.join(10)
    async_engine.engine.shutdown()
    if http_failed.is_set():
        logging.getLogger(__name__).error("the HTTP server stopped (see above); exiting")
    return 1 if async_engine.error is not None or http_failed.is_set() else 0
