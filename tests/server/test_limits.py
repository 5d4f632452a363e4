"""The body-size limit, in process (httpx.ASGITransport): refused with 413 before the handler
runs, whether the body announces its length or streams in chunks; smaller bodies reach the
handler whole."""
from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from shardserve.server.limits import BodyLimitMiddleware

LIMIT = 1000


def app_and_calls():
    app, calls = FastAPI(), []

    @app.post("/echo")
    async def echo(request: Request):
        calls.append(len(await request.body()))
        return {"bytes": calls[-1]}

    app.add_middleware(BodyLimitMiddleware, max_bytes=LIMIT)
    return app, calls


def post(app, content) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/echo", content=content)
    return asyncio.run(go())


def chunks(total: int, size: int = 100):
    async def gen():
        for start in range(0, total, size):
            yield b"x" * min(size, total - start)
    return gen()


def test_bodies_over_the_limit_get_413_and_never_reach_the_handler():
    app, calls = app_and_calls()
    for content in (b"x" * (LIMIT + 1), chunks(LIMIT + 1)):  # announced length; chunked
        refused = post(app, content)
        assert refused.status_code == 413 and refused.json()["error"]["type"] == "invalid_request_error"
    assert calls == []


def test_bodies_within_the_limit_reach_the_handler_whole():
    app, calls = app_and_calls()
    assert post(app, b"x" * LIMIT).json() == {"bytes": LIMIT}
    assert post(app, chunks(LIMIT, 7)).json() == {"bytes": LIMIT}
    assert calls == [LIMIT, LIMIT]
