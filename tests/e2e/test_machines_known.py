"""Machines are known, as a person meets it: the CLI and the gateway over the session
fleet (`alpha`, `beta`).

- `cmdop-worker run --machine alhpa` exits 2 naming the closest known names on
  stderr, and starts nothing; a known machine that is offline runs, with a warning on
  stderr.
- `POST /v1/runs {"machine": "alhpa"}` answers 422 `{"error", "message"}`; a known
  offline machine 201 with `warnings`; the OpenAPI document describes `warnings`.
- `cmdop-worker machines --all` lists an offline machine with when it was last seen
  (`--json`: `online`, `last_seen_ms`); plain `machines` does not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest

from cmdop_worker.models import MachinePresence
from cmdop_worker.state.presence import announce, leave
from cmdop_worker.surfaces.gateway_schema import openapi_document
from tests.e2e.test_cli import cli, cli_env, text  # noqa: F401  (the CLI's environment)
from tests.gateway_proc import GatewayProcess, call

pytestmark = pytest.mark.e2e

TOKEN = "tok-known-3b9e1f"


@pytest.fixture
def env(cli_env) -> dict[str, str]:  # noqa: F811
    return cli_env


def gone_machine(client, name: str) -> None:
    """A machine that joined once and left: known, offline."""
    presence = MachinePresence(machine=name, host="old-host", pid=1, started_ms=0, tools=[])
    announce(client.redis, client.keys, presence, ttl_ms=60_000)
    leave(client.redis, client.keys, name)


@pytest.fixture(scope="module")
def gateway(fleet, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    env = {**fleet_env, "CMDOP_GATEWAY_TOKENS": TOKEN}
    log = tmp_path_factory.mktemp("gateway-known") / "gateway.log"
    gw = GatewayProcess(env, log=log).start()
    try:
        fleet.wait_ready(["alpha", "beta"], timeout_s=60)
        yield gw
    finally:
        gw.stop()


def test_run_on_a_machine_never_seen_exits_2_naming_the_closest(env, client) -> None:
    run_id = uuid.uuid4().hex
    done = cli(env, "run", "hello", "--machine", "alhpa", "--json", "--timeout", "30")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "unknown machine 'alhpa'" in done.stderr
    assert "closest known names: alpha" in done.stderr
    assert done.stdout == ""  # no run id: nothing was started
    assert not client.redis.exists(client.keys.start(run_id))


def test_run_on_a_known_offline_machine_warns_and_runs(env, client, script) -> None:
    gone_machine(client, "cli-gone")
    prompt = script([text("nothing to do there")])
    done = cli(env, "run", prompt, "--machine", "cli-gone", "--json")
    assert done.returncode == 0, done.stderr
    assert "warning: machine 'cli-gone' is offline (last seen " in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["type"] == "DONE"


def test_the_gateway_refuses_a_machine_never_seen_with_422(gateway, client) -> None:
    run_id = uuid.uuid4().hex
    reply = call(
        gateway.url,
        "POST",
        "/v1/runs",
        {"run_id": run_id, "prompt": "hi", "machine": "alhpa"},
        token=TOKEN,
    )
    assert reply.status == 422, reply.body
    assert reply.body["error"] == "invalid_request"
    assert reply.body["message"].startswith("machine: unknown machine 'alhpa'")
    assert "closest known names: alpha" in reply.body["message"]
    assert not client.redis.exists(client.keys.start(run_id))


def test_the_gateway_accepts_a_known_offline_machine_with_warnings(gateway, client, script) -> None:
    gone_machine(client, "gw-gone")
    prompt = script([text("nothing to do there")])
    reply = call(
        gateway.url, "POST", "/v1/runs", {"prompt": prompt, "machine": "gw-gone"}, token=TOKEN
    )
    assert reply.status == 201, reply.body
    (warning,) = reply.body["warnings"]
    assert warning.startswith("machine 'gw-gone' is offline (last seen ")
    body = {"prompt": prompt, "machine": "alpha"}
    online = call(gateway.url, "POST", "/v1/runs", body, token=TOKEN)
    assert online.status == 201 and "warnings" not in online.body
    created = openapi_document()["components"]["schemas"]["RunCreated"]
    assert created["properties"]["warnings"]["anyOf"][0]["type"] == "array"


def test_machines_all_lists_offline_machines_with_when_last_seen(env, client) -> None:
    gone_machine(client, "list-gone")
    online_only = cli(env, "machines", "--json")
    assert online_only.returncode == 0, online_only.stderr
    assert "list-gone" not in [m["machine"] for m in json.loads(online_only.stdout)]
    listed = cli(env, "machines", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    by_name = {m["machine"]: m for m in json.loads(listed.stdout)}
    assert by_name["list-gone"]["online"] is False
    assert isinstance(by_name["list-gone"]["last_seen_ms"], int)
    assert by_name["alpha"]["online"] is True and by_name["alpha"]["host"]
    table = cli({**env, "COLUMNS": "200"}, "machines", "--all")
    row = next(line for line in table.stdout.splitlines() if "list-gone" in line)
    assert "offline" in row and " ago (" in row and "UTC" in row
