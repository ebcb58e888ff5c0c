"""Machine labels and selectors through real workers: three machine workers started with
`--label` flags and CMDOP_MACHINE_LABELS (flags over the variable, key by key) beside
the session's unlabelled `alpha` and `beta`; each surface selects from their presences:
`cmdop-worker machines --selector`, the gateway's `/v1/machines?selector=`, the
`list_machines` tool through the coordinator, and the viewer's selector box. A bad
selector is exit 2 with where it went wrong, a 422, an error tool result, and a line
beside the box; a bad label keeps a worker from starting.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from cmdop_worker.core.selectors import parse_selector
from tests.e2e.test_cli import cli, cli_env  # noqa: F401  (the CLI's environment)
from tests.e2e.test_viewer import browser  # noqa: F401  (the module's chromium)
from tests.gateway_proc import CLI, GatewayProcess, call
from tests.integration.machines.machine_runs import calls_then_report, finish, use

pytestmark = pytest.mark.e2e

TOKEN = "labels-token-9c2e"
LABELLED = {
    "sel-web-eu": {"role": "web", "region": "eu"},
    "sel-web-us": {"role": "web", "region": "us", "canary": ""},
    "sel-db-eu": {"role": "db", "region": "eu", "example.com/tier": "gold"},
}
KNOWN = {**LABELLED, "alpha": {}, "beta": {}}
SELECTIONS = [
    "*",
    "role=web",
    "role==web,region!=us",
    "region in (eu,us),!canary",
    "role notin (web)",
    "canary",
    "!role",
    "example.com/tier=gold",
    "role=web,role=db",
]


def expected(selector: str) -> set[str]:
    """The known machines `selector` names, by the labels they were started with."""
    chosen = parse_selector(selector)
    return {name for name, labels in KNOWN.items() if chosen.matches(labels)}


@pytest.fixture(scope="module")
def labelled(fleet) -> Iterator[None]:
    fleet.start_machine("sel-web-eu", labels=["role=web", "region=eu"])
    # The variable gives role=db; the flag puts role=web over it and adds canary.
    env = {"CMDOP_MACHINE_LABELS": "region=us,role=db"}
    fleet.start_machine("sel-web-us", env, labels=["role=web", "canary="])
    fleet.start_machine(
        "sel-db-eu", {"CMDOP_MACHINE_LABELS": "role=db, region=eu,example.com/tier=gold"}
    )
    try:
        fleet.wait_ready([*LABELLED, "alpha", "beta"], timeout_s=60)
        yield
    finally:
        for name in LABELLED:
            fleet.workers.pop(name).stop()


@pytest.fixture(scope="module")
def gateway(labelled, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    env = {**fleet_env, "CMDOP_GATEWAY_TOKENS": TOKEN}
    log = tmp_path_factory.mktemp("labels") / "gateway.log"
    gw = GatewayProcess(env, log=log).start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def env(labelled, cli_env) -> dict[str, str]:  # noqa: F811
    return cli_env


def known(names: list[str]) -> set[str]:
    return set(names) & set(KNOWN)


def test_each_presence_carries_the_labels_its_worker_started_with(labelled, client) -> None:
    found = {p.machine: p.labels for p in client.machines()}
    assert {name: found[name] for name in KNOWN} == KNOWN


@pytest.mark.parametrize("selector", SELECTIONS)
def test_machines_selector_lists_the_matching_machines(env, selector: str) -> None:
    done = cli(env, "machines", "--selector", selector, "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert known([m["machine"] for m in listed]) == expected(selector)
    assert all(m["labels"] == KNOWN[m["machine"]] for m in listed if m["machine"] in KNOWN)


def test_the_machines_table_shows_labels(env) -> None:
    done = cli({**env, "COLUMNS": "300"}, "machines", "--selector", "region=eu")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if "sel-" in line}
    assert set(rows) == {"sel-web-eu", "sel-db-eu"}
    assert "region=eu, role=web" in rows["sel-web-eu"]
    assert "example.com/tier=gold, region=eu, role=db" in rows["sel-db-eu"]
    nothing = cli(env, "machines", "--selector", "role=web,role=db")
    assert "no machines online match role=db,role=web" in nothing.stdout


def test_a_bad_selector_exits_2_saying_where(env) -> None:
    done = cli(env, "machines", "--selector", "role in web")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "at column 9: expected '(' to open the list of values, found 'web'" in done.stderr
    assert "role in web\n        ^" in done.stderr


@pytest.mark.parametrize("selector", SELECTIONS)
def test_the_gateway_filters_machines_by_selector(gateway, selector: str) -> None:
    reply = call(gateway.url, "GET", f"/v1/machines?selector={quote(selector)}", token=TOKEN)
    assert reply.status == 200, reply.body
    assert known([m["machine"] for m in reply.body]) == expected(selector)


def test_the_gateway_lists_every_machine_without_a_selector(gateway) -> None:
    reply = call(gateway.url, "GET", "/v1/machines", token=TOKEN)
    assert reply.status == 200
    assert known([m["machine"] for m in reply.body]) == set(KNOWN)


@pytest.mark.parametrize("selector", ["", "role in ()", "Role-=x", "cpu>4"])
def test_the_gateway_refuses_a_bad_selector_with_422(gateway, selector: str) -> None:
    reply = call(gateway.url, "GET", f"/v1/machines?selector={quote(selector)}", token=TOKEN)
    assert reply.status == 422
    assert reply.body["error"] == "invalid_request"
    assert reply.body["message"].startswith("selector: bad selector")
    assert "at column" in reply.body["message"]


def test_list_machines_takes_a_selector_and_a_bad_one_is_an_error_result(
    labelled, client, script
) -> None:
    prompt = script(
        calls_then_report(
            use("list_machines", selector="role=web"),
            use("list_machines", selector="region in (eu"),
            use("list_machines", selector=7),
        )
    )
    done = finish(client, prompt)
    assert done.result.status == "done"
    good, bad, wrong_type = done.ends
    assert not good.data["is_error"], good.data
    listed = json.loads(good.data["output"])
    assert known([m["machine"] for m in listed]) == expected("role=web")
    assert {m["machine"]: m["labels"] for m in listed} == {
        name: KNOWN[name] for name in expected("role=web")
    }
    assert bad.data["is_error"]
    assert "invalid arguments for list_machines" in bad.data["output"]
    assert "at column 14: expected ',' or ')'" in bad.data["output"]
    assert wrong_type.data["is_error"]
    assert "a selector is a string" in wrong_type.data["output"]


@pytest.mark.parametrize(
    ("args", "variable", "words"),
    [
        (["--machine", "sel-bad", "--label", "Role-=x"], "", "label key 'Role-'"),
        (["--machine", "sel-bad", "--label", "role"], "", "label 'role': expected KEY=VALUE"),
        (["--machine", "sel-bad"], "role=w b", "label value 'w b'"),
        (["--coordinator", "--label", "role=web"], "", "goes with --machine"),
    ],
)
def test_a_worker_with_a_bad_label_does_not_start(
    env, args: list[str], variable: str, words: str
) -> None:
    done = subprocess.run(
        [CLI, "worker", *args],
        env={**env, "CMDOP_MACHINE_LABELS": variable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "cmdop-worker: invalid labels: " in done.stderr and words in done.stderr


def test_the_viewer_filters_the_machine_picker_by_selector(browser, gateway) -> None:  # noqa: F811
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(gateway.url + "/")
        page.fill("#token", TOKEN)
        page.dispatch_event("#token", "change")
        page.wait_for_selector("#machines li[data-machine=sel-db-eu]")
        page.fill("#selector", "role=web,region!=us")
        page.press("#selector", "Enter")
        page.wait_for_selector("#machines li[data-machine=sel-db-eu]", state="detached")
        assert shown(page) & set(KNOWN) == {"sel-web-eu"}
        assert picker(page) & set(KNOWN) == {"sel-web-eu"}
        assert "region=eu,role=web" in page.text_content("#machines li[data-machine=sel-web-eu]")

        page.fill("#selector", "role in web")
        page.press("#selector", "Enter")
        page.wait_for_selector("#selector-error:has-text('at column 9')")
        page.fill("#selector", "")
        page.press("#selector", "Enter")
        page.wait_for_selector("#machines li[data-machine=alpha]")
        assert page.text_content("#selector-error") == ""
        assert shown(page) >= set(KNOWN)
    finally:
        context.close()
    assert errors == [], errors


def shown(page: Any) -> set[str]:
    items = page.query_selector_all("#machines li[data-machine]")
    return {li.get_attribute("data-machine") for li in items}


def picker(page: Any) -> set[str]:
    return {o.get_attribute("value") for o in page.query_selector_all("#machine option")} - {""}
