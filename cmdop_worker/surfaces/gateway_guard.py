"""The gateway's door: the ASGI middleware that enforces `gateway_auth` and
`gateway_browser`.

`HostCheck`, in front of every path (the page too): a Host the gateway does not answer
to is 400 — a page at a rebound name reads nothing and starts nothing. Starlette's
TrustedHostMiddleware checks the name only and answers in plain text; this one checks
the port as well and answers like every other refusal.

`Guard`, in front of every API route, in this order: the bearer token's verdict
(`authorize`), the caller's rate (`RateLimiter`, keyed by its token, else by its
address, so guesses at a token are limited too), then 401 / 403 for a refused token,
403 for a browser's request from another site or a token-less write without
`X-Cmdop-Client`, 415 for a POST that is not `application/json`, then the body's size —
a declared `Content-Length` over the limit is refused before a byte is read, and a body
sent without one is counted as it arrives. Every refusal is a JSON `{"error",
"message"}`. The page, its static files, `/healthz` and `/openapi.json` hold no run data
and pass the Guard untouched. `json_error` is the one shape of an error body. A request
let through carries the name of its token (`caller_name`) in its state, as `CALLER`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cmdop_worker.surfaces.gateway_auth import (
    RateLimiter,
    Tokens,
    authorize,
    bearer,
    caller_name,
)
from cmdop_worker.surfaces.gateway_browser import (
    CLIENT_HEADER,
    HostRule,
    client_header_refusal,
    content_type_refusal,
    host_allowed,
    site_refusal,
)

GUARDED_PREFIX = "/v1/"
CALLER = "cmdop_caller"  # in the request's state: the name of the token it presented
Refusal = tuple[int, bytes, dict[str, str]]


def json_error(status: int, code: str, message: str, **extra: Any) -> tuple[int, bytes]:
    return status, json.dumps({"error": code, "message": message, **extra}).encode()


class HostCheck:
    def __init__(self, app: ASGIApp, *, rules: list[HostRule]) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not host_allowed(host, self.rules):
                shown = "no Host header" if host is None else f"Host '{host[:100]}'"
                message = (
                    f"{shown}: not a name this gateway answers to "
                    "(CMDOP_GATEWAY_ALLOWED_HOSTS names more)"
                )
                await _respond(send, *json_error(400, "invalid_host", message))
                return
        await self.app(scope, receive, send)


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: Tokens,
        limiter: RateLimiter,
        max_body_bytes: int,
        cors_origins: list[str] | None = None,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.cors_origins = list(cors_origins or [])
        self.clock_s = clock_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers) or self._browser_refusal(scope, headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        # Who calls, for the routes: an approval is recorded as given by its token's name.
        caller = caller_name(self.tokens, headers.get("authorization"))
        scope.setdefault("state", {})[CALLER] = caller
        body = await self._body(headers, receive)
        if body is None:
            message = f"the body is over the limit of {self.max_body_bytes} bytes"
            # The rest of the body is never read: the connection cannot carry another request.
            closing = {"connection": "close"}
            await _respond(send, *json_error(413, "body_too_large", message), closing)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope, headers: Headers) -> Refusal | None:
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

    def _browser_refusal(self, scope: Scope, headers: Headers) -> Refusal | None:
        method = scope["method"]
        message = site_refusal(
            headers.get("sec-fetch-site"), headers.get("origin"), self.cors_origins
        )
        if message is not None:
            return *json_error(403, "cross_site", message), {}
        message = client_header_refusal(self.tokens.configured, method, headers.get(CLIENT_HEADER))
        if message is not None:
            return *json_error(403, "client_header_required", message), {}
        if method == "POST":
            message = content_type_refusal(headers.get("content-type"))
            if message is not None:
                return *json_error(415, "unsupported_media_type", message), {}
        return None

    async def _body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole request body, or None when it is over the limit."""
        declared = headers.get("content-length")
        if declared is not None and _over(declared, self.max_body_bytes):
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


def _over(declared: str, limit: int) -> bool:
    """Whether a Content-Length says more than `limit` (18 digits: past any real one)."""
    digits = declared.isascii() and declared.isdigit()
    return digits and (len(declared) > 18 or int(declared) > limit)


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
