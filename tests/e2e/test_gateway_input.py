"""What the gateway refuses at its door and in what it reads, over plain HTTP to a real
`cmdop-worker gateway` process without tokens (on loopback): every malformed input is
the exact 4xx naming the problem, starts no run, and the gateway serves on (`/healthz`
answers after each). The Host it answers to, the header a token-less gateway needs, the
content type of a POST, where a browser says a request comes from; then resume points,
bodies too deep, numbers too long, bytes that are not UTF-8, JSON that is not an object.
"""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cmdop_worker.surfaces.client import Client
from tests.gateway_proc import CLI, GatewayProcess, call

pytestmark = pytest.mark.e2e

CLIENT = {"X-Cmdop-Client": "test"}
JSON = {"Content-Type": "application/json", **CLIENT}
RUN_PATHS = ("/v1/runs", "/v1/threads/{rid}-th/runs")


@pytest.fixture(scope="module")
def gateway(fleet, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    env = {k: v for k, v in fleet_env.items() if k != "CMDOP_GATEWAY_TOKENS"}
    env |= {"CMDOP_GATEWAY_RATE_PER_S": "1000", "CMDOP_GATEWAY_RATE_BURST": "1000"}
    gw = GatewayProcess(env, log=tmp_path_factory.mktemp("gw-input") / "gateway.log").start()
    try:
        yield gw
    finally:
        gw.stop()


def assert_refused(
    gw: GatewayProcess, client: Client, reply: Any, status: int, code: str, words: str, rid: str
) -> None:
    assert (reply.status, reply.body["error"]) == (status, code), reply.body
    assert words in reply.body["message"], reply.body["message"]
    assert not client.redis.exists(client.keys.state(rid), client.keys.events(rid))
    assert call(gw.url, "GET", "/healthz").status == 200, gw.logs()[-3000:]


def body_for(rid: str, **extra: Any) -> bytes:
    return json.dumps({"run_id": rid, "prompt": "[[script:none]] x", **extra}).encode()


DOOR = [
    # (headers, status, error, words)
    ({"X-Cmdop-Client": "t"}, 415, "unsupported_media_type", "needs Content-Type"),
    ({"Content-Type": "text/plain", **CLIENT}, 415, "unsupported_media_type", "text/plain"),
    ({"Content-Type": "application/x-www-form-urlencoded", **CLIENT}, 415,
     "unsupported_media_type", "not application/json"),
    ({"Content-Type": "multipart/form-data; boundary=x", **CLIENT}, 415,
     "unsupported_media_type", "not application/json"),
    ({"Content-Type": "application/json; charset=latin-1", **CLIENT}, 415,
     "unsupported_media_type", "must be UTF-8"),
    ({"Content-Type": "application/json"}, 403, "client_header_required", "X-Cmdop-Client"),
    ({**JSON, "Sec-Fetch-Site": "cross-site", "Origin": "http://evil.test"}, 403, "cross_site",
     "http://evil.test"),
    ({**JSON, "Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"}, 403, "cross_site",
     "another origin"),
]  # fmt: skip


@pytest.mark.parametrize(("headers", "status", "code", "words"), DOOR)
@pytest.mark.parametrize("path", RUN_PATHS)
def test_a_write_a_browser_page_could_send_is_refused(
    gateway, client, path, headers, status, code, words
) -> None:
    rid = f"in-{uuid.uuid4().hex[:8]}"
    reply = call(gateway.url, "POST", path.format(rid=rid), raw=body_for(rid), headers=headers)
    assert_refused(gateway, client, reply, status, code, words, rid)


def test_what_passes_the_door_is_served(gateway, client) -> None:
    """The same request, from a client (charset given, or a browser on the same origin)."""
    for extra in (
        {"Content-Type": "application/json; charset=UTF-8"},
        {"Sec-Fetch-Site": "same-origin"},
    ):
        rid = f"in-{uuid.uuid4().hex[:8]}"
        reply = call(gateway.url, "POST", "/v1/runs", raw=body_for(rid), headers={**JSON, **extra})
        assert reply.status == 201, reply.body
        assert client.run(rid).wait(timeout=60, raise_on_failure=False).run_id == rid


@pytest.mark.parametrize(
    "host",
    [
        "evil.test",
        "evil.test:{port}",
        "127.0.0.1.evil.test:{port}",
        "127.0.0.1:1",
        "[::2]:{port}",
        "a b",
    ],
)
@pytest.mark.parametrize("path", ["/v1/runs", "/v1/machines", "/", "/healthz", "/static/viewer.js"])
def test_a_host_it_does_not_answer_to_is_400_on_every_path(gateway, client, host, path) -> None:
    rid = f"in-{uuid.uuid4().hex[:8]}"
    headers = {**JSON, "Host": host.format(port=gateway.port)}
    method = "POST" if path == "/v1/runs" else "GET"
    reply = call(
        gateway.url, method, path, raw=body_for(rid) if method == "POST" else None, headers=headers
    )
    assert_refused(
        gateway, client, reply, 400, "invalid_host", "not a name this gateway answers to", rid
    )


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}", "127.0.0.1"],
)
def test_its_own_loopback_names_are_served(gateway, host) -> None:
    reply = call(
        gateway.url, "GET", "/v1/machines", headers={"Host": host.format(port=gateway.port)}
    )
    assert reply.status == 200, reply.body


def test_a_request_with_no_host_header_is_400(gateway) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/machines HTTP/1.0\r\n\r\n")
        answer = sock.makefile("rb").read()
    assert answer.split()[1] == b"400" and b'"invalid_host"' in answer, answer[:300]
    assert call(gateway.url, "GET", "/healthz").status == 200


LONG = "7" * 5000
RESUME = [
    # (header or None, query, words)
    ("\u00b2", "", "Last-Event-ID: '\\xb2' is not a seq"),
    ("\u0663".encode(), "", "Last-Event-ID: '\\xd9\\xa3' is not a seq"),  # as UTF-8 bytes
    (LONG, "", "Last-Event-ID: '7777777777"),
    ("-1", "", "Last-Event-ID: '-1' is not a seq"),
    ("1e3", "", "Last-Event-ID: '1e3' is not a seq"),
    (None, "?after=%C2%B2", "after: '\\xb2' is not a seq"),
    (None, "?after=%D9%A3", "after: '\\u0663' is not a seq"),
    (None, f"?after={LONG}", "is more than 20 digits"),
    (None, "?after=-5", "after: '-5' is not a seq"),
    (None, "?after=0x10", "after: '0x10' is not a seq"),
]


@pytest.mark.parametrize(("header", "query", "words"), RESUME)
def test_a_malformed_resume_point_is_422(gateway, client, header, query, words) -> None:
    headers = {} if header is None else {"Last-Event-ID": header}
    rid = f"in-{uuid.uuid4().hex[:8]}"
    reply = call(gateway.url, "GET", f"/v1/runs/{rid}/events{query}", headers=headers)
    assert_refused(gateway, client, reply, 422, "invalid_request", words, rid)


def deep(levels: int) -> bytes:
    return b'{"prompt": "x", "metadata": ' + b"[" * levels + b"]" * levels + b"}"


BODIES = [
    # (raw body, words)
    (b"[" * 200_000, "nested deeper than 64 levels"),
    (deep(65), "nested deeper than 64 levels"),
    (b'{"prompt": "x", "max_turns": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8 (byte 15"),
    (b"\xef\xbb\xbf{}", "not JSON"),  # a byte-order mark
    (b'{"prompt": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "x", "max_turns": Infinity}', "Infinity is not a JSON number"),
    (b'{"prompt": "\\ud800"}', "unpaired surrogate"),
    (b"[1, 2]", "expected a JSON object, not an array"),
    (b'"run"', "expected a JSON object, not a string"),
    (b"null", "expected a JSON object, not null"),
    (b"42", "expected a JSON object, not a number"),
    (b'{"prompt": ', "not JSON"),
]


@pytest.mark.parametrize(
    ("raw", "words"), BODIES, ids=lambda v: repr(v)[:30] if isinstance(v, bytes) else None
)
@pytest.mark.parametrize(
    "path", [*RUN_PATHS, "/v1/runs/{rid}/cancel", "/v1/runs/{rid}/approvals/toolu_x"]
)
def test_a_malformed_body_is_422_naming_it(gateway, client, raw, words, path) -> None:
    rid = f"in-{uuid.uuid4().hex[:8]}"
    reply = call(gateway.url, "POST", path.format(rid=rid), raw=raw, headers=JSON)
    assert_refused(gateway, client, reply, 422, "invalid_request", words, rid)


def test_where_it_may_listen_and_for_which_names(fleet_env, tmp_path) -> None:
    env = {k: v for k, v in fleet_env.items() if not k.startswith("CMDOP_GATEWAY")}
    tokened = {**env, "CMDOP_GATEWAY_TOKENS": "tok-3b1"}
    refusals = [
        (tokened, "0.0.0.0", "set CMDOP_GATEWAY_ALLOWED_HOSTS"),
        ({**env, "CMDOP_GATEWAY_ALLOWED_HOSTS": "*"}, "127.0.0.1", "=* with no token"),
        ({**tokened, "CMDOP_GATEWAY_ALLOWED_HOSTS": "gw.test:http"}, "0.0.0.0", "'gw.test:http'"),
    ]
    for run_env, host, words in refusals:
        done = subprocess.run([CLI, "gateway", "--host", host, "--port", "0"], env=run_env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and words in done.stderr, (host, done.stderr)
    named = {**env, "CMDOP_GATEWAY_ALLOWED_HOSTS": "gw.test, *.fleet.test"}
    gw = GatewayProcess(named, log=tmp_path / "gw.log").start()
    try:
        cases = [
            ("gw.test", 200),
            (f"gw.test:{gw.port}", 200),
            ("a.fleet.test:443", 200),
            ("fleet.test", 400),
            ("gw.test.evil", 400),
            (f"127.0.0.1:{gw.port}", 200),
        ]
        for host, status in cases:
            reply = call(gw.url, "GET", "/v1/machines", headers={"Host": host})
            assert reply.status == status, host
    finally:
        gw.stop()
