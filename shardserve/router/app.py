"""The router's HTTP API: the OpenAI endpoints of a single server (clients cannot tell the
difference), plus /admin for adding, draining and listing replicas.

    POST /v1/completions, /v1/chat/completions   forwarded (forwarding.py)
    GET  /v1/models, /v1/models/{model}          the replicas' models, with each replica's card
    GET  /health                                 200 while some replica is routable
    GET  /metrics                                the router's Prometheus metrics
    GET  /admin/status                           replicas: state, load, in flight, model card
    POST /admin/replicas {"url": ...}            add a replica (probed before it takes traffic)
    POST /admin/replicas/drain {"url": ...}      no new requests; removed once idle
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shardserve.config import RouterConfig
from shardserve.router.admission import RouterError
from shardserve.router.forwarding import Forwarder
from shardserve.router.health import HealthMonitor
from shardserve.router.lease import Lease
from shardserve.router.metrics import RouterMetrics
from shardserve.router.policies import make_policy
from shardserve.router.replica_pool import ReplicaPool
from shardserve.router.stream_relay import StreamRelay
from shardserve.server.auth import AuthConfig, AuthMiddleware
from shardserve.server.limits import BodyLimitMiddleware
from shardserve.server.protocol import error_body


class Router:
    """The state behind the app: the pool, the policy, the forwarding and the health checks."""

    def __init__(self, config: RouterConfig, auth: AuthConfig = AuthConfig()):
        self.config, self.auth = config, auth
        self.pool = ReplicaPool(list(config.replicas), config.eject_after_failures, config.eject_base_s,
                                config.eject_max_s)
        self.metrics = RouterMetrics(config.policy)
        # the router calls its replicas (requests and probes) with its own key
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024),
                                        headers=auth.bearer_header())
        policy = make_policy(config.policy, config.prefix_chars, config.prefix_load_slack)
        self.forwarder = Forwarder(config, self.pool, policy, self.client, self.metrics)
        self.health = HealthMonitor(self.pool, self.client, config.probe_interval_s, config.probe_timeout_s)

    def status(self) -> dict:
        return {"policy": self.config.policy, "replicas": [
            {"url": r.url, "state": r.state, "outstanding": r.outstanding, "consecutive_failures": r.consecutive_failures,
             "ejections": self.pool.num_ejections.get(r.url, 0), "load": vars(r.load), "model": r.info}
            for r in self.pool.replicas.values()]}

    async def forward(self, kind: str, path: str, request: Request) -> Response:
        """One client request: parsed, admitted, sent (retried, resumed) and answered."""
        received_at = time.monotonic()
        body = await _json_object(request)
        request_class = request.headers.get("x-request-class")
        if request_class and "request_class" not in body:
            body["request_class"] = request_class
        forwarder = self.forwarder
        forwarder.admit(body)
        body = forwarder.prepare(body)
        prefix = _prompt_prefix(body, self.config.prefix_chars)
        interactive = forwarder.lease_interactive(body)  # None for batch work
        try:
            if body.get("stream"):
                status, result = await forwarder.open_stream(kind, path, body, prefix, received_at)
                if status != 200:
                    return JSONResponse(result, status_code=status)
                response, interactive = EventStreamResponse(result, interactive), None  # it releases the lease
                return response
            status, answer = await forwarder.complete(path, body, prefix, received_at)
            return JSONResponse(answer, status_code=status)
        finally:
            if interactive is not None:
                interactive.release()

    async def forward_utility(self, path: str, request: Request) -> Response:
        """A request that generates nothing (/tokenize, /detokenize): to any replica, as it is,
        retried elsewhere on a failure; no admission, no seed."""
        status, answer = await self.forwarder.complete(path, await _json_object(request), "", time.monotonic())
        return JSONResponse(answer, status_code=status)

    def models(self) -> dict:
        """The fleet's models (/v1/models): each model's card, with the replicas serving it."""
        cards: dict[str, dict] = {}
        for replica in self.pool.replicas.values():
            if replica.info:
                card = cards.setdefault(replica.info.get("id"), {k: v for k, v in replica.info.items()} | {"replicas": []})
                card["replicas"].append({"url": replica.url, "state": replica.state,
                                         **{k: replica.info[k] for k in ("layout",) if k in replica.info}})
        return {"object": "list", "data": list(cards.values())}


def build_router_app(config: RouterConfig, auth: AuthConfig = AuthConfig()) -> tuple[FastAPI, Router]:
    router = Router(config, auth)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.health.check_all()  # know who is up before the first request
        task = asyncio.ensure_future(router.health.run())
        yield
        task.cancel()
        await router.client.aclose()

    app = FastAPI(title="shardserve router", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(AuthMiddleware, config=auth)  # outermost: no key, nothing read

    @app.exception_handler(RouterError)
    async def router_error(_, exc: RouterError):
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward("completion", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.forward("chat", "/v1/chat/completions", request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.forward_utility("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.forward_utility("/detokenize", request)

    @app.get("/v1/models")
    async def models():
        return router.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        card = next((c for c in router.models()["data"] if c.get("id") == name), None)
        if card is None:
            return JSONResponse(error_body(404, f"the model {name!r} does not exist", "model"), status_code=404)
        return card

    @app.get("/health")
    async def health():
        if not router.pool.routable():
            return JSONResponse(error_body(503, "no replica is available"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router.pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/admin/status")
    async def status():
        return router.status()

    @app.post("/admin/replicas")
    async def add_replica(request: Request):
        url = (await request.json()).get("url")
        if not url:
            return JSONResponse(error_body(400, "give the replica's url", "url"), status_code=400)
        replica = router.pool.add(url)
        await router.health.check(replica)
        return {"url": replica.url, "state": replica.state}

    @app.post("/admin/replicas/drain")
    async def drain_replica(request: Request):
        url = (await request.json()).get("url", "")
        replica = router.pool.drain(url)
        if replica is None:
            return JSONResponse(error_body(404, f"no replica {url!r}", "url"), status_code=404)
        return {"url": replica.url, "state": replica.state, "outstanding": replica.outstanding}

    return app, router


class EventStreamResponse(StreamingResponse):
    """A streamed answer that, however it ends (finished, the client gone mid-stream or before
    the first byte, when the relay was never read), closes the relay (its replica's lease and
    response) and releases the request's interactive lease."""

    def __init__(self, relay: StreamRelay, interactive: Lease | None):
        super().__init__(relay, media_type="text/event-stream")
        self.relay, self.interactive = relay, interactive

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.interactive is not None:
                self.interactive.release()
            await self.relay.aclose()


async def _json_object(request: Request) -> dict:
    """The request's body as a JSON object; RouterError 400 (the app answers it) otherwise."""
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object")
    return body


def _prompt_prefix(body: dict, num_chars: int) -> str:
    """The start of the request's prompt text (for prefix-aware routing)."""
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role') if isinstance(message, dict) else ''}:{content or ''}\n")
            if sum(map(len, parts)) >= num_chars:
                break
        return "".join(parts)[:num_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    return (prompt if isinstance(prompt, str) else json.dumps(prompt))[:num_chars]
