"""The HTTP gateway through a real fleet: a `cmdop-worker gateway` process (uvicorn)
over the session's Redis, coordinator and machines, driven with plain HTTP.

Create and stream; resume after a dropped connection at arbitrary events with nothing
lost or repeated (against the run's stored events); cancel; approvals; threads with
on_busy; and the door, by attack: no token, a wrong one, a read-only token on every
write, oversized bodies (declared and chunked), bursts, and an open gateway that
refuses to listen beyond loopback.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cmdop_worker.models import Event
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.gateway_schema import openapi_document
from cmdop_worker.surfaces.typed_events import typed_event
from tests.e2e.test_cli import text, tool
from tests.gateway_proc import CLI, GatewayProcess, Reply, call, read_sse
from tests.procs import gone_within, sleeper, wait_for_sleeper

pytestmark = pytest.mark.e2e

TOKEN, RO_TOKEN = "tok-full-7f3a9c", "tok-read-51e2b8"
TOKEN_NAME = "ops-team"  # an approval given with TOKEN is recorded as given by it
MAX_BODY = 65_536
WORDS = " ".join(f"w{i}" for i in range(120))
ASKER = "gw-asker"


@pytest.fixture(scope="module")
def gateway(fleet, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    fleet.start_machine(
        ASKER, {"CMDOP_PERMISSION_MODE": "default", "CMDOP_APPROVAL_TIMEOUT_S": "30"}
    )
    env = {
        **fleet_env,
        "CMDOP_GATEWAY_TOKENS": f"{TOKEN_NAME}={TOKEN}, ro:{RO_TOKEN}",
        "CMDOP_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY),
        "CMDOP_GATEWAY_RATE_PER_S": "1000",
        "CMDOP_GATEWAY_RATE_BURST": "1000",
    }
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    gw = GatewayProcess(env, log=log).start()
    try:
        fleet.wait_ready(["alpha", "beta", ASKER], timeout_s=60)
        yield gw
    finally:
        gw.stop()
        fleet.workers.pop(ASKER).stop()


def post(gw: GatewayProcess, path: str, body: Any, token: str | None = TOKEN) -> Reply:
    return call(gw.url, "POST", path, body, token=token)


def get(gw: GatewayProcess, path: str, token: str | None = TOKEN) -> Reply:
    return call(gw.url, "GET", path, token=token)


def start(gw: GatewayProcess, request: dict[str, Any]) -> str:
    reply = post(gw, "/v1/runs", request)
    assert reply.status == 201, reply.body
    return str(reply.body["run_id"])


def stored(client: Client, run_id: str) -> list[Event]:
    client.run(run_id).wait(timeout=60, raise_on_failure=False)
    return client.events_so_far(run_id)


def tokens_text(events: list[dict[str, Any]] | list[Event]) -> str:
    as_dicts = [e if isinstance(e, dict) else e.model_dump() for e in events]
    return "".join(e["data"]["text"] for e in as_dicts if e["type"] == "TOKEN")


def test_create_then_stream_every_event_in_order_and_the_stream_closes(gateway, client, script):
    prompt = script([[tool("alpha", "echo one"), tool("beta", "echo two")], text("both ok")])
    run_id = start(gateway, {"prompt": prompt})
    read = read_sse(gateway.url, f"/v1/runs/{run_id}/events", token=TOKEN)
    assert read.status == 200 and read.closed_by_server
    assert read.ids == [e["seq"] for e in read.events] == list(range(1, len(read.events) + 1))
    for event in read.events:
        typed_event(event)
    assert read.events[-1]["type"] == "DONE" and read.events[-1]["data"]["text"] == "both ok"
    assert {e["data"]["machine"] for e in read.events if e["type"] == "TOOL_END"} == {
        "alpha",
        "beta",
    }
    assert read.events == [e.model_dump() for e in stored(client, run_id)]

    view = get(gateway, f"/v1/runs/{run_id}")
    assert view.status == 200
    assert view.body["status"] == "done" and view.body["last_seq"] == len(read.events)
    assert view.body["result"]["text"] == "both ok"
    replay = read_sse(gateway.url, f"/v1/runs/{run_id}/events", token=TOKEN)
    assert replay.events == read.events and replay.closed_by_server
    done = read_sse(gateway.url, f"/v1/runs/{run_id}/events?after={len(read.events)}", token=TOKEN)
    assert done.status == 204


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resume_after_a_dropped_connection_loses_and_repeats_nothing(gateway, client, script, seed):
    """Drop the stream at random events, live and after the end, resuming alternately
    with Last-Event-ID and with ?after=: the pieces join into the stored events."""
    steps = [[tool("alpha", "echo a"), tool("beta", "echo b")], text(WORDS)]
    run_id = start(gateway, {"prompt": script(steps, token_delay_ms=5)})
    rng = random.Random(seed)
    seen: list[dict[str, Any]] = []
    ids: list[int] = []
    cuts = 0
    for attempt in range(200):
        last = ids[-1] if ids else 0
        path = f"/v1/runs/{run_id}/events"
        if attempt % 2:
            read = read_sse(
                gateway.url, path, token=TOKEN, last_event_id=last, stop_after=rng.randint(1, 6)
            )
        else:
            read = read_sse(
                gateway.url, f"{path}?after={last}", token=TOKEN, stop_after=rng.randint(1, 6)
            )
        if read.status == 204:
            break
        assert read.status == 200
        seen += read.events
        ids += read.ids
        cuts += not read.closed_by_server
        if seen and seen[-1]["type"] == "DONE":
            break
    events = stored(client, run_id)
    assert ids == [e.seq for e in events] == list(range(1, len(events) + 1))
    assert seen == [e.model_dump() for e in events]
    assert tokens_text(seen) == tokens_text(events) == WORDS
    assert cuts >= 3, f"the stream was cut {cuts} times: the test proved little"


def test_a_ui_cancel_stops_a_long_tool(gateway, client, script):
    command = sleeper(60)
    run_id = start(gateway, {"prompt": script([[tool("alpha", command)], text("never")])})
    pid = wait_for_sleeper(command, timeout_s=30)
    reply = post(gateway, f"/v1/runs/{run_id}/cancel", {"channel": "ui", "reason": "from http"})
    assert reply.status == 202 and reply.body["cancelling"] is True
    read = read_sse(gateway.url, f"/v1/runs/{run_id}/events", token=TOKEN)
    end = read.events[-1]
    assert end["type"] == "CANCELLED" and end["data"]["channel"] == "ui"
    assert end["data"]["reason"] == "from http"
    assert gone_within(pid, 20)
    again = post(gateway, f"/v1/runs/{run_id}/cancel", {"channel": "operation"})
    assert again.status == 409 and again.body["error"] == "run_ended"
    nobody = post(gateway, "/v1/runs/no-such-run/cancel", {"channel": "ui"})
    assert nobody.status == 404
    bad = post(gateway, f"/v1/runs/{run_id}/cancel", {"channel": "loud"})
    assert bad.status == 422 and "channel" in bad.body["message"]


def test_approve_deny_and_edit_through_http_and_what_is_not_waiting(gateway, client, script):
    steps = [[tool(ASKER, "echo first"), tool(ASKER, "echo second"), tool(ASKER, "echo third")]]
    run_id = start(gateway, {"prompt": script([*steps, text("answered")])})
    asked: dict[str, dict[str, Any]] = {}
    for event in client.run(run_id).events(idle_timeout_s=30):
        if event.type == "APPROVAL_REQUEST":
            asked[event.data["input"]["command"]] = event.data
        if len(asked) == 3:
            break
    first, second, third = (
        asked[f"echo {n}"]["tool_call_id"] for n in ("first", "second", "third")
    )
    base = f"/v1/runs/{run_id}/approvals"
    # An answer to a request the call's record does not ask (a forged event) is refused.
    swapped = {**asked["echo first"], "input": {"machine": ASKER, "command": "echo swapped"}}
    changed = post(gateway, f"{base}/{first}", {"approve": True, "shown": swapped})
    assert changed.status == 409 and changed.body["why"] == "changed", changed.body
    shown = asked["echo first"]
    ok = post(gateway, f"{base}/{first}", {"approve": True, "by": "alice", "shown": shown})
    assert ok.status == 200, ok.body
    assert ok.body == {"run_id": run_id, "tool_call_id": first, "verdict": "approved",
                       "tool": "execute_command", "machine": ASKER}  # fmt: skip
    no = post(gateway, f"{base}/{second}", {"approve": False, "reason": "not today"})
    assert no.status == 200 and no.body["verdict"] == "denied"
    edited = {"command": "echo edited-by-http"}
    assert post(gateway, f"{base}/{third}", {"approve": True, "input": edited}).status == 200

    events = stored(client, run_id)
    ends = {e.data["tool_call_id"]: e.data for e in events if e.type == "TOOL_END"}
    assert ends[first]["status"] == "ok" and "first" in ends[first]["output"]
    assert ends[second]["status"] == "denied"
    assert "edited-by-http" in ends[third]["output"]
    resolved = {e.data["tool_call_id"]: e.data for e in events if e.type == "APPROVAL_RESOLVED"}
    assert resolved[first]["by"] == f"alice (via {TOKEN_NAME})"  # the body says, the token is
    assert resolved[second]["by"] == resolved[third]["by"] == TOKEN_NAME
    assert resolved[third]["input"]["command"] == edited["command"]

    twice = post(gateway, f"{base}/{first}", {"approve": False})
    assert twice.status == 409 and twice.body["why"] == "answered"
    assert f"already been answered (approved by alice (via {TOKEN_NAME}))" in twice.body["message"]
    unknown = post(gateway, f"{base}/toolu_nope", {"approve": True})
    assert unknown.status == 404 and unknown.body["why"] == "no_request"
    no_run = post(gateway, "/v1/runs/no-such-run/approvals/toolu_nope", {"approve": True})
    assert no_run.status == 404 and no_run.body["error"] == "not_found"
    mixed = post(gateway, f"{base}/{first}", {"approve": True, "reason": "why"})
    assert mixed.status == 422 and mixed.body["message"].startswith("reason:")


def test_a_by_with_a_line_break_or_control_is_refused_and_nothing_is_recorded(
    gateway, fleet_env, client, script
):
    """Through the gateway (422) and the CLI's --by (exit 2): a `by` that would start a
    line of its own under "(via NAME)", or hide or reorder text, answers nothing."""
    run_id = start(gateway, {"prompt": script([[tool(ASKER, "echo by-check")], text("ok")])})
    asked = next(
        e.data for e in client.run(run_id).events(idle_timeout_s=30) if e.type == "APPROVAL_REQUEST"
    )
    call_id = asked["tool_call_id"]
    path = f"/v1/runs/{run_id}/approvals/{call_id}"
    for by in ("bob\n[approved by bob]", "bob\u2028x", "bob\u202ex", "bob\x85x", "bob\x1b[8m"):
        refused = post(gateway, path, {"approve": True, "by": by, "shown": asked})
        assert refused.status == 422, (by, refused.body)
        assert refused.body["message"].startswith("invalid body: by:"), refused.body
        cli = subprocess.run([CLI, "approve", run_id, call_id, "--by", by], env=fleet_env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert cli.returncode == 2, (by, cli.stdout, cli.stderr)
        assert "--by holds a control character" in cli.stderr
    events = client.events_so_far(run_id)
    assert not [e for e in events if e.type in ("APPROVAL_RESOLVED", "TOOL_END")]
    assert post(gateway, path, {"approve": True, "by": "bob", "shown": asked}).status == 200
    resolved = [e.data for e in stored(client, run_id) if e.type == "APPROVAL_RESOLVED"]
    assert [r["by"] for r in resolved] == [f"bob (via {TOKEN_NAME})"]


def test_an_ambiguous_token_entry_is_refused_at_start_without_showing_it(fleet_env):
    """`carol=ro:T` (the prefix after the name) would be a FULL token whose value is
    `ro:T`; a token holding `=` reads two ways too. The gateway does not start."""
    secret = "CCCCtoken3333"
    for tokens, entry in (
        (f"alice=AAAAtoken1111, ro:bob=BBBBtoken2222, carol=ro:{secret}", "entry 3 (carol)"),
        (f"alice=AAAAtoken1111, {secret}==", "entry 2"),
    ):
        env = {**fleet_env, "CMDOP_GATEWAY_TOKENS": tokens}
        done = subprocess.run([CLI, "gateway", "--host", "127.0.0.1", "--port", "0"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        said = done.stderr.strip()
        assert said.startswith(
            f"cmdop-worker gateway: refusing to start: CMDOP_GATEWAY_TOKENS {entry}"
        )
        assert len(said.splitlines()) == 1, said
        assert secret not in done.stdout + done.stderr
        assert "AAAA" not in done.stderr and "BBBB" not in done.stderr


def test_an_expired_approval_says_so(gateway, fleet, client, script):
    fleet.start_machine(
        "gw-quick", {"CMDOP_PERMISSION_MODE": "default", "CMDOP_APPROVAL_TIMEOUT_S": "1"}
    )
    try:
        fleet.wait_ready(["gw-quick"], timeout_s=60)
        run_id = start(gateway, {"prompt": script([[tool("gw-quick", "echo late")], text("late")])})
        events = stored(client, run_id)
    finally:
        fleet.workers.pop("gw-quick").stop()
    (request,) = [e for e in events if e.type == "APPROVAL_REQUEST"]
    late = post(gateway, f"/v1/runs/{run_id}/approvals/{request.data['tool_call_id']}", {})
    assert late.status == 409 and late.body["why"] == "expired"
    assert "expired after 1 s" in late.body["message"]


def test_a_bad_request_is_422_naming_the_field_and_starts_nothing(gateway, client):
    run_id = f"gw-bad-{uuid.uuid4().hex[:8]}"
    cases = [
        ({"run_id": run_id, "prompt": "x", "max_turns": 0}, "max_turns"),
        ({"run_id": run_id, "prompt": "x", "machine": "Not A Machine"}, "machine"),
        ({"run_id": run_id}, "prompt"),
        ({"run_id": "bad id!", "prompt": "x"}, "run_id"),
    ]
    for body, field in cases:
        reply = post(gateway, "/v1/runs", body)
        assert reply.status == 422, (body, reply.body)
        assert reply.body["error"] == "invalid_request" and field in reply.body["message"]
    json_type = {"Content-Type": "application/json"}
    not_json = call(gateway.url, "POST", "/v1/runs", raw=b"{nope", token=TOKEN, headers=json_type)
    assert not_json.status == 422 and not_json.body["message"].startswith("body:")
    assert not client.redis.exists(client.keys.state(run_id), client.keys.events(run_id))
    assert client.celery.AsyncResult(f"{run_id}.start").state == "PENDING"  # never sent
    assert get(gateway, f"/v1/runs/{run_id}").status == 404
    assert get(gateway, "/v1/runs/bad%20id/events").status == 422
    assert get(gateway, "/v1/runs/x/events?after=minus").status == 422


def test_a_thread_run_honours_on_busy(gateway, client, script):
    thread = f"gw-th-{uuid.uuid4().hex[:10]}"
    command = sleeper(4)
    path = f"/v1/threads/{thread}/runs"
    first = post(gateway, path, {"prompt": script([[tool("alpha", command)], text("first done")])})
    assert first.status == 201 and first.body["status"] == "running", first.body
    wait_for_sleeper(command, timeout_s=30)

    busy = post(gateway, path, {"prompt": "second?", "on_busy": "reject"})
    assert busy.status == 409 and busy.body["error"] == "thread_busy"
    assert first.body["run_id"] in busy.body["message"]
    steer = post(gateway, path, {"prompt": "also check beta", "on_busy": "steer"})
    assert steer.status == 200, steer.body
    assert steer.body["status"] == "steered" and steer.body["run_id"] == first.body["run_id"]
    assert steer.body["steered_from"] != first.body["run_id"]
    queued = post(gateway, path, {"prompt": script([text("third done")]), "on_busy": "enqueue"})
    assert queued.status == 201 and queued.body["status"] == "queued"
    mismatch = post(gateway, path, {"prompt": "x", "thread_id": "another"})
    assert mismatch.status == 422 and "thread_id" in mismatch.body["message"]

    events = stored(client, first.body["run_id"])
    assert any(e.type == "STEERED" and e.data["text"] == "also check beta" for e in events)
    later = client.run(queued.body["run_id"]).wait(timeout=60)
    assert later.status == "done" and later.run_id != first.body["run_id"]


def test_machines_healthz_and_openapi(gateway):
    machines = get(gateway, "/v1/machines")
    assert machines.status == 200
    assert {"alpha", "beta"} <= {m["machine"] for m in machines.body}
    assert call(gateway.url, "GET", "/healthz").body == {"status": "ok"}
    doc = call(gateway.url, "GET", "/openapi.json").body
    assert doc == openapi_document()
    schemas = doc["components"]["schemas"]
    assert schemas["RunRequest"]["properties"].keys() >= {"prompt", "thread_id", "on_busy"}
    assert set(schemas["Event"]["discriminator"]["mapping"]) >= {
        "TOKEN",
        "DONE",
        "APPROVAL_RESOLVED",
    }
    assert {"/v1/runs", "/v1/runs/{run_id}/events", "/v1/threads/{thread_id}/runs"} <= set(
        doc["paths"]
    )


# --- the door, by attack -----------------------------------------------------------


WRITES = [
    ("/v1/runs", {"prompt": "x"}),
    ("/v1/runs/r1/cancel", {"channel": "ui"}),
    ("/v1/runs/r1/approvals/toolu_x", {"approve": True}),
    ("/v1/threads/t1/runs", {"prompt": "x"}),
]
READS = ["/v1/machines", "/v1/runs/r1", "/v1/runs/r1/events"]


def test_no_token_or_a_wrong_one_is_401_everywhere_under_v1(gateway, client):
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "x", f"ro:{RO_TOKEN}", ""):
        for path, body in WRITES:
            reply = post(gateway, path, body, token=token)
            assert reply.status == 401, (path, token, reply.body)
            assert (
                reply.body["error"] == "unauthorized"
                and reply.headers["www-authenticate"] == "Bearer"
            )
        for path in READS:
            assert get(gateway, path, token=token).status == 401, (path, token)
    basic = call(gateway.url, "GET", "/v1/machines", headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status == 401
    assert not client.redis.exists(client.keys.state("r1"))


def test_a_read_only_token_reads_but_every_write_is_403(gateway, client, script):
    for path, body in WRITES:
        reply = post(gateway, path, body, token=RO_TOKEN)
        assert reply.status == 403, (path, reply.body)
        assert reply.body["error"] == "forbidden" and "read-only" in reply.body["message"]
    assert get(gateway, "/v1/machines", token=RO_TOKEN).status == 200
    run_id = start(gateway, {"prompt": script([text("read me")])})
    read = read_sse(gateway.url, f"/v1/runs/{run_id}/events", token=RO_TOKEN)
    assert read.status == 200 and read.events[-1]["data"]["text"] == "read me"


def test_an_oversized_body_is_413_declared_or_chunked(gateway, client):
    run_id = f"gw-big-{uuid.uuid4().hex[:8]}"
    big = {"run_id": run_id, "prompt": "x" * (MAX_BODY + 10)}
    reply = post(gateway, "/v1/runs", big)
    assert reply.status == 413 and reply.body["error"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        head = json.dumps({"run_id": run_id, "prompt": ""})[:-2].encode()
        payload = head + b"y" * (MAX_BODY + 10)
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]
        yield b'"}'

    import select
    import socket

    # A raw socket: the gateway answers 413 and closes while the body is still coming,
    # so the send may fail (a broken pipe) before the answer is read; both are fine.
    head = (
        f"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        try:
            sock.sendall(head)
            for piece in chunks():
                if select.select([sock], [], [], 0)[0]:
                    break  # answered already: stop sending, read the answer
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status_line = sock.makefile("rb").readline()
    assert status_line.split()[1] == b"413", status_line
    assert not client.redis.exists(client.keys.state(run_id))
    small = post(gateway, "/v1/runs", {"run_id": run_id, "prompt": "[[script:none]] " + "z" * 1000})
    assert small.status == 201  # the limit, not the endpoint, refused the others


def test_a_burst_is_429_with_retry_after(fleet_env, tmp_path):
    env = {**fleet_env, "CMDOP_GATEWAY_TOKENS": TOKEN, "CMDOP_GATEWAY_RATE_PER_S": "0.5",
           "CMDOP_GATEWAY_RATE_BURST": "5"}  # fmt: skip
    gw = GatewayProcess(env, log=tmp_path / "gw.log").start()
    try:
        statuses = [get(gw, "/v1/machines").status for _ in range(12)]
        assert statuses[:5] == [200] * 5 and set(statuses[5:]) == {429}, statuses
        limited = get(gw, "/v1/machines")
        assert limited.body["error"] == "rate_limited" and int(limited.headers["retry-after"]) >= 1
        guesses = [get(gw, "/v1/machines", token=f"guess-{i}").status for i in range(10)]
        assert 429 in guesses, "guessing tokens is not rate limited"
        assert call(gw.url, "GET", "/healthz").status == 200  # healthchecks are not limited
    finally:
        gw.stop()


def test_without_tokens_it_refuses_to_listen_beyond_loopback(fleet_env):
    env = {k: v for k, v in fleet_env.items() if k != "CMDOP_GATEWAY_TOKENS"}
    for host in ("0.0.0.0", "::", "192.0.2.10", "example.internal"):
        done = subprocess.run([CLI, "gateway", "--host", host, "--port", "0"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, (host, done.stderr)
        assert f"refusing to listen on {host}: no token is configured" in done.stderr
        assert "CMDOP_GATEWAY_TOKENS" in done.stderr


def test_without_tokens_on_loopback_it_is_open(fleet_env, tmp_path, script):
    """Open to a client that says it is one: a web page cannot add the header."""
    gw = GatewayProcess(dict(fleet_env), log=tmp_path / "gw.log").start()
    try:
        prompt = script([text("open")])
        bare = call(gw.url, "POST", "/v1/runs", {"prompt": prompt})
        assert bare.status == 403 and bare.body["error"] == "client_header_required"
        assert "X-Cmdop-Client" in bare.body["message"]
        headers = {"X-Cmdop-Client": "curl"}
        reply = call(gw.url, "POST", "/v1/runs", {"prompt": prompt}, headers=headers)
        assert reply.status == 201
        read = read_sse(gw.url, f"/v1/runs/{reply.body['run_id']}/events")
        assert read.events[-1]["data"]["text"] == "open"
    finally:
        gw.stop()


def test_cors_is_off_by_default_and_on_for_named_origins(gateway, fleet_env, tmp_path):
    origin = {"Origin": "https://dash.example", "Access-Control-Request-Method": "POST"}
    plain = call(gateway.url, "OPTIONS", "/v1/runs", headers=origin)
    assert "access-control-allow-origin" not in plain.headers
    env = {
        **fleet_env,
        "CMDOP_GATEWAY_TOKENS": TOKEN,
        "CMDOP_GATEWAY_CORS_ORIGINS": "https://dash.example",
    }
    gw = GatewayProcess(env, log=tmp_path / "gw.log").start()
    try:
        pre = call(
            gw.url,
            "OPTIONS",
            "/v1/runs",
            headers={**origin, "Access-Control-Request-Headers": "authorization"},
        )
        assert (
            pre.status == 200
            and pre.headers["access-control-allow-origin"] == "https://dash.example"
        )
        other = call(
            gw.url, "OPTIONS", "/v1/runs", headers={**origin, "Origin": "https://evil.example"}
        )
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
        assert (
            call(gw.url, "GET", "/v1/machines", headers={"Origin": "https://dash.example"}).status
            == 401
        )
    finally:
        gw.stop()
