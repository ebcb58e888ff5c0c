"""The run viewer page in a real browser: Playwright driving Debian's chromium against a
`cmdop-worker gateway` process over the session's fleet.

A person types a prompt and watches tool rows appear on two machines, presses Stop
during a long tool and sees CANCELLED with the tool stopped; reloads mid-run and sees
the answer continue from where it was, every token once; answers approvals with the
buttons. The page runs under its own Content-Security-Policy (its own files only, no
eval), so the tests wait with selectors, never with evaluated script.
`VIEWER_SCREENSHOT=docs/viewer.png pytest tests/e2e/test_viewer.py` refreshes the
README's picture of a finished run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from cmdop_worker.core.figures import usage_line
from cmdop_worker.models import MAX_PROMPT_CHARS
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import RedisServer
from tests.e2e.test_cli import text, tool
from tests.gateway_proc import GatewayProcess
from tests.procs import gone_within, sleeper, wait_for, wait_for_sleeper

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
TOKEN = "viewer-token-4d81"
TOKEN_NAME = "viewer-alice"  # who an approval given with TOKEN is recorded as given by
ASKER = "viewer-asker"
TIMEOUT_MS = 30_000
WORDS = " ".join(f"tok{i}" for i in range(160))


@pytest.fixture(scope="module")
def gateway(fleet, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    fleet.start_machine(
        ASKER, {"CMDOP_PERMISSION_MODE": "default", "CMDOP_APPROVAL_TIMEOUT_S": "30"}
    )
    env = {**fleet_env, "CMDOP_GATEWAY_TOKENS": f"{TOKEN_NAME}={TOKEN}"}
    gw = GatewayProcess(env, log=tmp_path_factory.mktemp("viewer") / "gateway.log").start()
    try:
        fleet.wait_ready(["alpha", "beta", ASKER], timeout_s=60)
        yield gw
    finally:
        gw.stop()
        fleet.workers.pop(ASKER).stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no {CHROMIUM}: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@contextmanager
def opened(browser: Any, url: str, token: str | None = TOKEN) -> Iterator[Any]:
    """The viewer in a fresh browser context (nothing stored), its token typed in."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    if token is not None:
        enter_token(page, token)
    yield page
    context.close()
    assert errors == [], errors


def enter_token(page: Any, token: str) -> None:
    page.fill("#token", token)
    page.dispatch_event("#token", "change")


@pytest.fixture
def page(browser, gateway) -> Iterator[Any]:
    with opened(browser, gateway.url) as page:
        page.wait_for_selector("#machines li[data-machine=alpha]")
        page.wait_for_selector("#machines li[data-machine=beta]")
        yield page


def ask(page: Any, prompt: str, machine: str = "") -> str:
    page.fill("#prompt", prompt)
    if machine:
        page.select_option("#machine", machine)
    page.click("#run")
    page.wait_for_url(re.compile(r"[?&]run="))
    return str(parse_qs(urlsplit(page.url).query)["run"][0])


def row(page: Any, machine: str, state: str) -> str:
    return f"tr.tool-row[data-machine='{machine}'][data-state='{state}']"


def tokens_text(client: Client, run_id: str) -> str:
    return "".join(e.data["text"] for e in client.events_so_far(run_id) if e.type == "TOKEN")


def test_tool_rows_on_two_machines_then_stop_during_a_long_tool(page, client, script):
    long = sleeper(60)
    steps = [
        [*text("Checking both."), tool("alpha", "echo from-alpha"), tool("beta", "echo from-beta")],
        [tool("beta", long)],
        text("never shown"),
    ]
    run_id = ask(page, script(steps))
    page.wait_for_selector(row(page, "alpha", "ok"))
    page.wait_for_selector(row(page, "beta", "ok"))
    assert "from-alpha" in page.text_content(row(page, "alpha", "ok") + " td.output")
    assert "from-beta" in page.text_content(row(page, "beta", "ok") + " td.output")

    running = page.wait_for_selector(row(page, "beta", "running"))
    assert running.query_selector(".spinner") is not None
    pid = wait_for_sleeper(long, timeout_s=30)
    page.click("#stop")
    page.wait_for_selector("#status[data-status=CANCELLED]")
    stopped = page.query_selector(f"tr.tool-row[data-call='{running.get_attribute('data-call')}']")
    assert stopped.get_attribute("data-state") == "cancelled"
    assert stopped.query_selector(".spinner") is None
    assert page.is_disabled("#stop")
    assert "ui cancel: Stop button" in page.text_content("#usage")
    assert gone_within(pid, 20), "Stop did not kill the running tool"
    result = client.run(run_id).wait(timeout=30, raise_on_failure=False)
    assert result.status == "cancelled" and result.cancel.channel == "ui"


def test_reload_mid_run_continues_the_answer_without_repeats(page, client, script):
    run_id = ask(page, script([text(WORDS)], token_delay_ms=25))
    wait_for(lambda: len(page.text_content("#answer").split()) > 20, 30, "20 words of the answer")
    shown_seq = int(page.get_attribute("body", "data-seq"))
    resumed: list[str] = []
    page.on("request", lambda r: "/events" in r.url and resumed.append(r.url))
    page.reload()
    page.wait_for_selector("#status[data-status=DONE]")
    afters = [int(parse_qs(urlsplit(url).query)["after"][0]) for url in resumed]
    assert afters and afters[0] >= shown_seq > 0, f"the reload did not resume: {afters}"
    last_seq = client.events_so_far(run_id)[-1].seq
    assert afters[0] < last_seq - 1, "the run had ended before the reload: nothing was resumed"
    answer = page.text_content("#answer")
    assert answer == tokens_text(client, run_id) == WORDS
    # The same figures as the CLI's (core.figures), for the same run.
    usage = client.events_so_far(run_id)[-1].data["usage"]
    assert page.text_content("#usage") == f"DONE · 1 turn · {usage_line(usage)} · end_turn"


def test_approval_buttons_approve_one_call_and_deny_another(page, client, script):
    steps = [[tool(ASKER, "echo yes-please"), tool(ASKER, "echo no-thanks")], text("answered")]
    run_id = ask(page, script(steps))
    buttons = page.locator(f"{row(page, ASKER, 'waiting')} button.approve")
    buttons.first.wait_for()
    page.locator(row(page, ASKER, "waiting")).nth(1).wait_for()
    calls = {
        e.data["input"]["command"]: e.data["tool_call_id"]
        for e in client.events_so_far(run_id)
        if e.type == "APPROVAL_REQUEST"
    }
    page.click(f"tr[data-call='{calls['echo yes-please']}'] button.approve")
    page.click(f"tr[data-call='{calls['echo no-thanks']}'] button.deny")
    page.wait_for_selector("#status[data-status=DONE]")
    approved = page.locator(f"tr[data-call='{calls['echo yes-please']}']")
    assert approved.get_attribute("data-state") == "ok"
    assert "yes-please" in approved.locator("td.output").text_content()
    assert f"approved by {TOKEN_NAME}" in approved.text_content()
    denied = page.locator(f"tr[data-call='{calls['echo no-thanks']}']")
    assert denied.get_attribute("data-state") == "denied"
    assert page.locator("button.approve").count() == 0


def test_a_finished_run_renders_in_full(page, script, tmp_path):
    steps = [
        [
            *text("I'll check disk space on both machines."),
            tool("alpha", "df -h / | tail -1"),
            tool("beta", "uptime"),
        ],
        text("Both machines are healthy: / on alpha has room to spare and beta is idle."),
    ]
    ask(page, script(steps))
    page.wait_for_selector("#status[data-status=DONE]")
    assert page.locator("tr.tool-row").count() == 2
    assert " cache read · " in page.text_content("#usage")
    shot = Path(os.environ.get("VIEWER_SCREENSHOT") or tmp_path / "viewer.png")
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def notice_says(page: Any, status: int) -> str:
    """The notice, once it shows a refusal with this status: visible wherever the page is."""
    page.wait_for_selector(f"#notice:has-text('{status} ')", state="visible")
    return str(page.text_content("#notice"))


def test_no_token_or_a_wrong_one_shows_401_and_asks_for_the_token(browser, gateway):
    with opened(browser, gateway.url, token=None) as page:
        said = notice_says(page, 401)
        assert said.startswith("401 unauthorized: a valid bearer token is required"), said
        page.wait_for_selector("#machines li:has-text('a token is required')")
        assert page.get_attribute("#token", "placeholder") == "required: this gateway needs a token"
        assert page.is_hidden("#run-view")  # no run yet: the notice is shown all the same

        enter_token(page, TOKEN + "-wrong")
        assert notice_says(page, 401).startswith("401 unauthorized")
        enter_token(page, TOKEN)
        page.wait_for_selector("#machines li[data-machine=alpha]")
        page.wait_for_selector("#notice", state="hidden")
        assert page.get_attribute("#token", "class") == ""  # no longer marked as needed


def test_a_prompt_over_the_limit_shows_422(browser, gateway, client):
    with opened(browser, gateway.url) as page:
        page.wait_for_selector("#machines li[data-machine=alpha]")
        page.fill("#prompt", "x" * (MAX_PROMPT_CHARS + 1))
        page.click("#run")
        said = notice_says(page, 422)
        assert said.startswith("422 invalid_request: invalid run request: prompt:"), said[:300]
        assert "run=" not in page.url and page.is_hidden("#run-view")


@pytest.fixture
def redis_down_gateway(fleet_env, tmp_path) -> Iterator[GatewayProcess]:
    """A gateway whose Redis stops once it is up."""
    redis = RedisServer().start()
    env = {**fleet_env, "CMDOP_REDIS_URL": redis.url, "CMDOP_GATEWAY_TOKENS": TOKEN}
    gw = GatewayProcess(env, log=tmp_path / "gateway.log").start()
    redis.stop()
    try:
        yield gw
    finally:
        gw.stop()
        redis.close()


def test_redis_down_shows_503(browser, redis_down_gateway):
    with opened(browser, redis_down_gateway.url) as page:
        said = notice_says(page, 503)
        assert said.startswith("503 unavailable: Redis is unreachable"), said
        page.fill("#prompt", "anything")
        page.click("#run")
        page.wait_for_selector("#notice:has-text('503 unavailable')", state="visible")
        assert "run=" not in page.url


def test_recent_runs_are_listed_and_reopen(page, client, script):
    first = ask(page, script([text("the first answer")]))
    page.wait_for_selector("#status[data-status=DONE]")
    page.fill("#thread", "viewer-thread-1")
    page.fill("#prompt", script([text("the second answer")]))
    page.click("#run")
    page.wait_for_url(lambda url: "run=" in url and first not in url)
    second = str(parse_qs(urlsplit(page.url).query)["run"][0])
    page.wait_for_selector("#status[data-status=DONE]")
    assert client.run(second).wait(timeout=30).status == "done"
    page.wait_for_selector(f"#recent-runs li[data-run='{first}']:has-text('DONE')")
    listed = page.locator("#recent-runs li").all_text_contents()
    assert listed[0].startswith(second) and "thread viewer-thread-1" in listed[0], listed
    assert any(line.startswith(first) for line in listed[1:]), listed

    page.click(f"#recent-runs li[data-run='{first}'] a")
    page.wait_for_url(re.compile(f"run={first}"))
    page.wait_for_selector("#status[data-status=DONE]")
    assert page.text_content("#run-id") == first
    assert page.text_content("#answer") == "the first answer"


def test_an_open_gateway_says_no_token_is_needed(browser, fleet, fleet_env, tmp_path):
    gw = GatewayProcess(dict(fleet_env), log=tmp_path / "gateway.log").start()
    try:
        with opened(browser, gw.url, token=None) as page:
            page.wait_for_selector("#machines li[data-machine=alpha]")
            page.wait_for_selector("#token[placeholder='none needed']")
            assert page.is_hidden("#notice")
    finally:
        gw.stop()
