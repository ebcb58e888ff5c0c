"""Every gateway error is a JSON `{"error", "message"}`: with Redis stopped under a live
gateway, every /v1 route answers 503 with Retry-After, its log holds one warning for
the outage and no traceback, and the routes answer again once Redis is back; a path or
a method the gateway lacks is a JSON 404 or 405, not Starlette's plain text."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cmdop_worker.surfaces.fleet import RedisServer
from tests.gateway_proc import GatewayProcess, Reply, call, read_sse

pytestmark = pytest.mark.e2e

TOKEN = "errors-token-0b7d"
WRITES = [
    ("/v1/runs", {"prompt": "x"}),
    ("/v1/runs/r1/cancel", {"channel": "ui"}),
    ("/v1/runs/r1/approvals/toolu_x", {"approve": True}),
    ("/v1/threads/t1/runs", {"prompt": "x"}),
]
READS = ["/v1/machines", "/v1/runs/r1", "/v1/runs/r1/events"]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def gateway(redis, tmp_path) -> Iterator[GatewayProcess]:
    env = {"CMDOP_REDIS_URL": redis.url, "CMDOP_GATEWAY_TOKENS": TOKEN}
    gw = GatewayProcess(env, log=tmp_path / "gateway.log").start()
    yield gw
    gw.stop()


def _json_error(reply: Reply, status: int, code: str) -> None:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json", reply.headers
    assert reply.body["error"] == code and reply.body["message"], reply.body


def test_redis_down_is_503_json_on_every_route_then_they_answer_again(redis, gateway) -> None:
    assert call(gateway.url, "GET", "/v1/machines", token=TOKEN).status == 200
    redis.stop()
    for _ in range(3):  # many failures: still one warning
        for path, body in WRITES:
            reply = call(gateway.url, "POST", path, body, token=TOKEN)
            _json_error(reply, 503, "unavailable")
            assert reply.headers["retry-after"] == "5"
            assert "Redis is unreachable" in reply.body["message"]
        for path in READS:
            _json_error(call(gateway.url, "GET", path, token=TOKEN), 503, "unavailable")
    assert read_sse(gateway.url, "/v1/runs/r1/events", token=TOKEN).status == 503
    assert call(gateway.url, "GET", "/healthz").status == 503

    log = gateway.logs()
    assert "Traceback" not in log and "Internal Server Error" not in log, log
    warnings = [line for line in log.splitlines() if "Redis unreachable" in line]
    assert len(warnings) == 1, log

    redis.start()
    assert call(gateway.url, "GET", "/v1/machines", token=TOKEN).status == 200
    assert call(gateway.url, "GET", "/v1/runs/r1", token=TOKEN).status == 404


def test_a_path_or_method_the_gateway_lacks_is_json(gateway) -> None:
    _json_error(call(gateway.url, "GET", "/v1/nothing-here", token=TOKEN), 404, "not_found")
    _json_error(call(gateway.url, "GET", "/nothing-here"), 404, "not_found")
    _json_error(call(gateway.url, "GET", "/v1/runs", token=TOKEN), 405, "method_not_allowed")
    _json_error(call(gateway.url, "DELETE", "/healthz"), 405, "method_not_allowed")


def test_the_openapi_document_names_503_on_every_v1_route(gateway) -> None:
    paths = call(gateway.url, "GET", "/openapi.json").body["paths"]
    v1 = {(path, method): op for path, ops in paths.items() for method, op in ops.items()}
    v1 = {key: op for key, op in v1.items() if key[0].startswith("/v1/")}
    assert len(v1) == 7
    assert [key for key, op in v1.items() if "503" not in op["responses"]] == []
