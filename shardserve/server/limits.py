"""Request-size limits that hold before a handler parses anything: a body over `max_bytes` is
answered 413 in the OpenAI error shape, whether it announces its length (refused before a byte
of it is read) or streams it in chunks (read here up to the limit, then handed on). Field limits (n, the
number of stop strings, ...) live in protocol.py, next to the fields."""
from __future__ import annotations

import json


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit():  # the HTTP server holds the client to it
            if int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # no length announced (chunked): read the body here, up to the limit, then hand it on
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body"):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        from shardserve.server.protocol import error_body

        body = json.dumps(error_body(413, f"request body is larger than {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
