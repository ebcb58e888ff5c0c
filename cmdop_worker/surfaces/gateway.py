"""`cmdop-worker gateway`: the HTTP API, its resumable SSE, and the run viewer page.

A thin process over the client and the state layer (Starlette, served by uvicorn):

    POST /v1/runs                          201 {"run_id", "status"} | 422 naming the field
    GET  /v1/runs/{id}                     status, last seq and result
    GET  /v1/runs/{id}/events              SSE: `id:` = seq; resume with Last-Event-ID or
                                           ?after=N; a finished run replays and closes
    POST /v1/runs/{id}/cancel              {"channel": "ui" | "operation", "reason"?}
    POST /v1/runs/{id}/approvals/{call}    {"approve", "input"?, "reason"?, "by"?, "shown"?}
    POST /v1/threads/{id}/runs             a run on the thread, as its on_busy says
    GET  /v1/machines[?selector=role=web]  the machines online (a label selector's)
    GET  /healthz, /openapi.json, /        (the run viewer, `static/`)

The write routes are `gateway_runs` (the client, in worker threads); the event stream
reads Redis from the event loop (`state.aio_events`), one connection per follower and
no thread. `gateway_guard` holds the door (Host, tokens, rate, where a browser's request
comes from, content type, body size); `gateway_input` reads what passes it, strictly.
CORS is off unless `CMDOP_GATEWAY_CORS_ORIGINS` names origins. Every error is a JSON
`{"error", "message"}`: the door's, the routes' (422, 404, 409), a path or method the
gateway lacks, and Redis unreachable (503 with Retry-After, one warning per outage in
the log). An approval is recorded as given by the name of the caller's token.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from cmdop_worker.config import Settings
from cmdop_worker.core.intake import describe_validation_error
from cmdop_worker.models import RUN_ID_PATTERN
from cmdop_worker.state.aio_events import async_redis_client, follow_events_async, progress
from cmdop_worker.state.connect import RedisConnectionError, RedisTimeoutError
from cmdop_worker.state.outage import OUTAGE
from cmdop_worker.surfaces import gateway_runs as runs
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.gateway_auth import (
    RateLimiter,
    Tokens,
    TokensError,
    bind_refusal,
    parse_tokens,
)
from cmdop_worker.surfaces.gateway_browser import (
    CLIENT_HEADER,
    HostRule,
    host_rules,
    hosts_refusal,
    parse_rules,
)
from cmdop_worker.surfaces.gateway_guard import CALLER, Guard, HostCheck
from cmdop_worker.surfaces.gateway_input import BadInput, json_object, selector, seq
from cmdop_worker.surfaces.gateway_schema import ApprovalBody, CancelBody, openapi_document

STATIC = Path(__file__).resolve().parent / "static"
RUN_ID = re.compile(RUN_ID_PATTERN)
CALL_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
PING_S = 15
RETRY_AFTER_S = 5
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError)  # Redis away: 503, not a 500
# The page loads nothing from elsewhere, and shows model output as text: a policy that
# allows only its own files makes any markup that slipped into it inert.
PAGE_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
}
Handler = Callable[[Request], Awaitable[Response]]


def answer(status: int, body: Any) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _path_id(request: Request, name: str, pattern: re.Pattern[str] = RUN_ID) -> str:
    value = str(request.path_params[name])
    if not pattern.match(value):
        raise BadInput(f"{name}: '{value[:80]}' is not a valid id")
    return value


async def _json_body(request: Request) -> dict[str, Any]:
    return json_object(await request.body())


async def _model_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(await _json_body(request))
    except ValidationError as exc:
        message = describe_validation_error(exc).replace("invalid run request", "invalid body")
        raise BadInput(message) from None


def _after(request: Request) -> int:
    """The seq to resume after: the Last-Event-ID a reconnecting reader sends, which is
    newer than the `?after=` of the URL it first opened, else `?after=`, else 0."""
    header = request.headers.get("last-event-id")
    if header:
        return seq(header, "Last-Event-ID")
    return seq(request.query_params.get("after") or "0", "after")


class Gateway:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.submitted = runs.Submitted()
        self.aredis: Any = None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.aredis = async_redis_client(self.settings.redis_url)
        try:
            yield
        finally:
            await self.aredis.aclose()

    async def create_run(self, request: Request) -> Response:
        payload = await _json_body(request)
        return answer(*await self._start(payload))

    async def thread_run(self, request: Request) -> Response:
        thread_id = _path_id(request, "thread_id")
        payload = await _json_body(request)
        named = payload.setdefault("thread_id", thread_id)
        if named != thread_id:
            raise BadInput(f"thread_id: the body names '{named}', the path '{thread_id}'")
        return answer(*await self._start(payload))

    async def _start(self, payload: Any) -> runs.Answer:
        wait_s = self.settings.gateway_start_wait_s
        return await run_in_threadpool(runs.start_run, self.client, payload, self.submitted, wait_s)

    async def get_run(self, request: Request) -> Response:
        run_id = _path_id(request, "run_id")
        return answer(*await run_in_threadpool(runs.view_run, self.client, run_id))

    async def cancel(self, request: Request) -> Response:
        run_id = _path_id(request, "run_id")
        body = await _model_body(request, CancelBody)
        done = await run_in_threadpool(runs.cancel_run, self.client, run_id, body, self.submitted)
        return answer(*done)

    async def approve(self, request: Request) -> Response:
        run_id = _path_id(request, "run_id")
        call_id = _path_id(request, "tool_call_id", CALL_ID)
        body = await _model_body(request, ApprovalBody)
        by = runs.approver(getattr(request.state, CALLER, None), body.by)
        done = await run_in_threadpool(runs.approve_call, self.client, run_id, call_id, body, by)
        return answer(*done)

    async def machines(self, request: Request) -> Response:
        chosen = selector(request.query_params.get("selector"))
        found = await run_in_threadpool(self.client.machines, chosen)
        return answer(200, [m.model_dump(mode="json") for m in found])

    async def events(self, request: Request) -> Response:
        run_id = _path_id(request, "run_id")
        after = _after(request)
        keys = self.client.keys
        at = await progress(self.aredis, keys, run_id)
        give_up = asyncio.get_running_loop().time() + self.settings.gateway_start_wait_s
        while not at.exists and asyncio.get_running_loop().time() < give_up:
            await asyncio.sleep(0.05)  # just submitted: no coordinator has stored it yet
            at = await progress(self.aredis, keys, run_id)
        if not at.exists:
            message = f"no run {run_id} (unknown, expired, or still queued for a coordinator)"
            return answer(404, {"error": "not_found", "message": message})
        if at.ended and after >= at.last_seq:
            return Response(status_code=204)  # an EventSource stops reconnecting on 204

        async def stream() -> AsyncIterator[ServerSentEvent]:
            try:
                async for event in follow_events_async(self.aredis, keys, run_id, after_seq=after):
                    yield ServerSentEvent(data=event.model_dump_json(), id=str(event.seq))
            except UNAVAILABLE as exc:  # the reader reconnects, and is told 503 until it is back
                OUTAGE.failed("gateway", exc)

        return EventSourceResponse(stream(), ping=PING_S, headers={"cache-control": "no-store"})

    async def healthz(self, request: Request) -> Response:
        try:
            await self.aredis.ping()
        except Exception as exc:
            return answer(503, {"status": "unavailable", "redis": str(exc)[:200]})
        return answer(200, {"status": "ok"})

    async def openapi(self, request: Request) -> Response:
        return answer(200, openapi_document())

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


def _guarded(handler: Handler) -> Handler:
    """The route, with its refusals as JSON: 422 for bad input, 503 while Redis is
    unreachable (one warning per outage in the log, `state.outage`, no traceback)."""

    async def wrapped(request: Request) -> Response:
        try:
            response = await handler(request)
        except BadInput as exc:
            return answer(422, {"error": "invalid_request", "message": exc.message})
        except UNAVAILABLE as exc:
            OUTAGE.failed("gateway", exc)
            message = "Redis is unreachable: the gateway can neither read nor start runs; retry"
            return JSONResponse(
                {"error": "unavailable", "message": message},
                status_code=503,
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        OUTAGE.reached()
        return response

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404 no such path, 405 wrong method) as JSON."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(
        {"error": code, "message": f"{request.method} {request.url.path}: {exc.detail}"},
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    """A fault of ours: JSON too (the traceback goes to the log, as a bug's should)."""
    message = "the gateway failed on this request; its log says why"
    return answer(500, {"error": "internal", "message": message})


def create_app(client: Client, settings: Settings, hosts: list[HostRule]) -> Starlette:
    """The app, answering to the Host names `hosts` (`gateway_browser.host_rules`)."""
    gw = Gateway(client, settings)
    routes = [
        Route("/v1/runs", _guarded(gw.create_run), methods=["POST"]),
        Route("/v1/runs/{run_id}", _guarded(gw.get_run), methods=["GET"]),
        Route("/v1/runs/{run_id}/events", _guarded(gw.events), methods=["GET"]),
        Route("/v1/runs/{run_id}/cancel", _guarded(gw.cancel), methods=["POST"]),
        Route("/v1/runs/{run_id}/approvals/{tool_call_id}", _guarded(gw.approve), methods=["POST"]),
        Route("/v1/threads/{thread_id}/runs", _guarded(gw.thread_run), methods=["POST"]),
        Route("/v1/machines", _guarded(gw.machines), methods=["GET"]),
        Route("/healthz", gw.healthz, methods=["GET"]),
        Route("/openapi.json", gw.openapi, methods=["GET"]),
        Route("/", gw.page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    limiter = RateLimiter(settings.gateway_rate_per_s, settings.gateway_rate_burst)
    tokens = parse_tokens(_secret(settings))
    guard = Middleware(
        Guard,
        tokens=tokens,
        limiter=limiter,
        max_body_bytes=settings.gateway_max_body_bytes,
        cors_origins=settings.gateway_cors_origins,
    )
    middleware = [Middleware(HostCheck, rules=hosts), guard]
    if settings.gateway_cors_origins:  # before the Guard: a preflight carries no token
        cors = Middleware(
            CORSMiddleware,
            allow_origins=settings.gateway_cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "last-event-id", CLIENT_HEADER],
        )
        middleware.insert(1, cors)
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=gw.lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )


def _secret(settings: Settings) -> str | None:
    tokens = settings.gateway_tokens
    return None if tokens is None else tokens.get_secret_value()


def serve(host: str, port: int) -> int:
    """Run the gateway in the foreground; 2 when it may not listen on `host`."""
    import uvicorn

    settings = Settings.from_env()
    try:
        tokens = parse_tokens(_secret(settings))
    except TokensError as exc:
        print(f"cmdop-worker gateway: refusing to start: {exc}", file=sys.stderr)
        return 2
    hosts = _start_refusal(host, port, tokens, settings.gateway_allowed_hosts)
    if isinstance(hosts, str):
        print(f"cmdop-worker gateway: {hosts}", file=sys.stderr)
        return 2
    with Client(settings) as client:
        app = create_app(client, settings, hosts)
        token = "a token is required" if tokens.configured else "no token needed"
        print(f"cmdop-worker gateway: run viewer at {viewer_url(host, port)} ({token})", flush=True)
        uvicorn.run(app, host=host, port=port, log_level="info")
    return 0


def viewer_url(host: str, port: int) -> str:
    """The viewer's URL for a gateway listening on `host`: any address is this host's name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"http://{host}:{port}/"


def _start_refusal(
    host: str, port: int, tokens: Tokens, allowed: list[str]
) -> str | list[HostRule]:
    """Why the gateway must not start, else the Host names it answers to."""
    try:
        rules = parse_rules(allowed)
    except ValueError as exc:
        return str(exc)
    refusal = bind_refusal(host, tokens) or hosts_refusal(host, rules, tokens.configured)
    return refusal if refusal is not None else host_rules(host, port, rules)
