"""The gateway's door: the ASGI middleware that enforces `gateway_auth` on `/v1/`.

In front of every API route, in this order: the bearer token's verdict (`authorize`),
the caller's rate (`RateLimiter`, keyed by its token, else by its address, so
guesses at a token are limited too), then 401 / 403 for a refused token, then the
body's size — a declared `Content-Length` over the limit is refused before a byte is
read, and a body sent without one is counted as it arrives. Every refusal is a JSON
`{"error", "message"}`. The page, its static files, `/healthz` and `/openapi.json`
hold no run data and pass untouched. `json_error` is the one shape of an error body.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cmdop_worker.surfaces.gateway_auth import RateLimiter, Tokens, authorize, bearer

GUARDED_PREFIX = "/v1/"


def json_error(status: int, code: str, message: str, **extra: Any) -> tuple[int, bytes]:
    return status, json.dumps({"error": code, "message": message, **extra}).encode()


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Tokens,
        limiter: RateLimiter,
        max_body_bytes: int,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.clock_s = clock_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        body = await self._body(headers, receive)
        if body is None:
            message = f"the body is over the limit of {self.max_body_bytes} bytes"
            # The rest of the body is never read: the connection cannot carry another request.
            closing = {"connection": "close"}
            await _respond(send, *json_error(413, "body_too_large", message), closing)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, bytes, dict[str, str]] | None:
        header = headers.get("authorization")
        verdict = authorize(self.tokens, header, scope["method"])
        client = scope.get("client") or ("unknown", 0)
        caller = (
            f"token:{bearer(header)}" if verdict in ("ok", "forbidden") else f"addr:{client[0]}"
        )
        wait_s = self.limiter.take(caller, self.clock_s())
        if wait_s > 0:
            retry = str(max(1, math.ceil(wait_s)))
            message = f"too many requests; retry in {retry} s"
            return *json_error(429, "rate_limited", message), {"retry-after": retry}
        if verdict == "unauthenticated":
            message = "a valid bearer token is required (Authorization: Bearer TOKEN)"
            return *json_error(401, "unauthorized", message), {"www-authenticate": "Bearer"}
        if verdict == "forbidden":
            message = f"this token is read-only: {scope['method']} is not allowed"
            return *json_error(403, "forbidden", message), {}
        return None

    async def _body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole request body, or None when it is over the limit."""
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the route sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


async def _respond(
    send: Send, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
