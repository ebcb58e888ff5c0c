"""Web pages against a gateway without tokens, in a real browser (Debian's chromium via
Playwright): a page served from another origin, and a page at a name made to resolve to
the gateway's address (DNS rebinding), try every way a browser lets a page send a request
— no-cors fetch, forms (urlencoded and text/plain), a preflighted JSON fetch, beacons,
images and scripts. The state that must not change: no attack run exists in Redis, and
the scripted model, whose script would run a tool, never hears of it. The same-origin
run viewer still starts and finishes a run on the same gateway.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import free_port
from tests.e2e.test_cli import text, tool
from tests.gateway_proc import GatewayProcess, call
from tests.procs import wait_for

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 30_000
# Two names that the browser resolves to 127.0.0.1: another site, and the rebinding one.
RESOLVER = "MAP evil.test 127.0.0.1, MAP rebind.test 127.0.0.1"
CLIENT = {"X-Cmdop-Client": "test"}
# Chromium asks before a page from a public address reaches a local one (Local Network
# Access): it stops the rebound page below, whose address it does not know. Other browsers
# have no such check, so it is off: the gateway has to refuse on its own.
NO_LNA = ",".join(
    [
        "LocalNetworkAccessChecks",
        "BlockInsecurePrivateNetworkRequests",
        "PrivateNetworkAccessSendPreflights",
    ]
)
# The requests a cross-origin page gets out of the browser with a body (the preflighted
# JSON fetch never leaves it): each would start a run, were the gateway to take it.
POSTS_OUT = {"nocors_text", "nocors_headers", "nocors_thread", "form_urlencoded", "form_text",
             "beacon_blob", "beacon_string"}  # fmt: skip

ATTACK_JS = r"""
const cfg = JSON.parse(document.getElementById("cfg").textContent);
const out = {};
const body = (name) => JSON.stringify({ run_id: `${cfg.prefix}-${name}`, prompt: cfg.prompt });
async function attempt(name, fn) {
  try { out[name] = await fn(); } catch (e) { out[name] = "error: " + e; }
}
function form(name, enctype) {
  // The classic JSON-in-a-form: the field's name is the JSON up to a dummy key, its value
  // closes it, so text/plain sends {"run_id":..,"prompt":..,"x":"="}: valid JSON.
  return new Promise((resolve) => {
    const frame = document.createElement("iframe");
    frame.name = "sink-" + name;
    document.body.append(frame);
    const f = document.createElement("form");
    f.method = "POST"; f.action = cfg.gw + "/v1/runs"; f.target = frame.name; f.enctype = enctype;
    const input = document.createElement("input");
    input.name = body(name).slice(0, -1) + ',"x":"';
    input.value = '"}';
    f.append(input);
    document.body.append(f);
    frame.onload = () => resolve("submitted");
    setTimeout(() => resolve("no load event"), 10000);
    f.submit();
  });
}
function tag(kind, path) {
  return new Promise((resolve) => {
    const el = document.createElement(kind);
    el.onload = () => resolve("loaded");
    el.onerror = () => resolve("error");
    el.src = cfg.gw + path;
    document.body.append(el);
  });
}
async function crossOrigin() {
  const url = cfg.gw + "/v1/runs";
  await attempt("nocors_text", () => fetch(url, { method: "POST", mode: "no-cors",
    headers: { "Content-Type": "text/plain" }, body: body("nocors_text") }).then((r) => r.type));
  // no-cors drops any header that is not safelisted: these never leave the browser.
  await attempt("nocors_headers", () => fetch(url, { method: "POST", mode: "no-cors",
    headers: { "Content-Type": "application/json", "X-Cmdop-Client": "1" },
    body: body("nocors_headers") }).then((r) => r.type));
  await attempt("nocors_thread", () => fetch(cfg.gw + `/v1/threads/${cfg.prefix}-th/runs`,
    { method: "POST", mode: "no-cors", body: body("nocors_thread") }).then((r) => r.type));
  const urlencoded = "application/x-www-form-urlencoded";
  await attempt("form_urlencoded", () => form("form_urlencoded", urlencoded));
  await attempt("form_text", () => form("form_text", "text/plain"));
  await attempt("cors_json", () => fetch(url, { method: "POST",
    headers: { "Content-Type": "application/json", "X-Cmdop-Client": "1" },
    body: body("cors_json") }).then((r) => r.status));
  await attempt("beacon_blob", () => navigator.sendBeacon(url,
    new Blob([body("beacon_blob")], { type: "text/plain" })));
  await attempt("beacon_string", () => navigator.sendBeacon(url, body("beacon_string")));
  await attempt("img_machines", () => tag("img", "/v1/machines"));
  await attempt("img_events", () => tag("img", `/v1/runs/${cfg.prefix}-x/events`));
  await attempt("script_machines", () => tag("script", "/v1/machines"));
}
async function rebound() {
  // Same origin, as far as the browser knows: every header can be sent and read.
  const headers = { "Content-Type": "application/json", "X-Cmdop-Client": "1" };
  await attempt("rebind_post", () => fetch("/v1/runs", { method: "POST", headers,
    body: body("rebind_post") }).then(async (r) => [r.status, await r.text()]));
  await attempt("rebind_read", () => fetch("/v1/machines").then((r) => r.status));
  await attempt("rebind_page", () => fetch("/").then((r) => r.status));
}
(cfg.rebound ? rebound() : crossOrigin()).then(() => {
  document.getElementById("out").textContent = JSON.stringify(out);
  document.body.dataset.done = "1";
});
"""


def attack_page(config: dict[str, Any]) -> str:
    cfg = json.dumps(config).replace("<", "\\u003c")
    return (
        '<!doctype html><meta charset="utf-8"><title>a page elsewhere</title><pre id="out"></pre>'
        f'<script type="application/json" id="cfg">{cfg}</script><script>{ATTACK_JS}</script>'
    )


class PageServer:
    """A web server of another origin: it serves one page, whatever the path."""

    def __init__(self) -> None:
        self.page = ""
        self.port = free_port()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = owner.page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def gateway(fleet, fleet_env, tmp_path_factory) -> Iterator[GatewayProcess]:
    env = {k: v for k, v in fleet_env.items() if k != "CMDOP_GATEWAY_TOKENS"}
    env |= {"CMDOP_GATEWAY_RATE_PER_S": "1000", "CMDOP_GATEWAY_RATE_BURST": "1000"}
    log = tmp_path_factory.mktemp("gateway-browser") / "gateway.log"
    gw = GatewayProcess(env, log=log).start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[PageServer]:
    server = PageServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no {CHROMIUM}: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as p:
        args = ["--no-sandbox", f"--host-resolver-rules={RESOLVER}", f"--disable-features={NO_LNA}"]
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


def gateway_traffic(page: Any, port: int) -> list[tuple[str, str, int]]:
    """Every answer the browser got from the gateway's port: (method, path, status)."""
    seen: list[tuple[str, str, int]] = []

    def record(response: Any) -> None:
        url = response.url
        if f":{port}/" in url:
            seen.append((response.request.method, url.split(f":{port}", 1)[1], response.status))

    page.on("response", record)
    return seen


def run_outcome(page: Any) -> dict[str, Any]:
    page.wait_for_selector("body[data-done='1']")
    return dict(json.loads(page.text_content("#out") or "{}"))


def assert_nothing_started(gw: GatewayProcess, client: Client, script, prompt: str, ids: list[str]):
    """No attack run exists, and the model was never asked. A run started through the
    front door afterwards finishes first, so the check is not merely early."""
    control = script([text("the door works")])
    reply = call(gw.url, "POST", "/v1/runs", {"prompt": control}, headers=CLIENT)
    assert reply.status == 201, reply.body
    assert client.run(reply.body["run_id"]).wait(timeout=60).text == "the door works"
    for run_id in ids:
        keys = client.keys
        found = client.redis.exists(keys.state(run_id), keys.events(run_id), keys.result(run_id))
        assert found == 0, f"the attack run {run_id} exists"
    assert script.requests_for(prompt) == [], "the model was asked to run the attack's script"


@pytest.mark.parametrize("site", ["127.0.0.1", "evil.test"])
def test_a_page_on_another_origin_cannot_start_a_run(
    site, page, gateway, elsewhere, client, script
) -> None:
    prefix = f"xo-{uuid.uuid4().hex[:8]}"
    prompt = script([[tool("alpha", f"echo {prefix}-ran")], text("pwned")])
    elsewhere.page = attack_page({"gw": gateway.url, "prefix": prefix, "prompt": prompt})
    traffic = gateway_traffic(page, gateway.port)
    page.goto(f"http://{site}:{elsewhere.port}/attack.html")
    outcome = run_outcome(page)
    assert outcome["cors_json"].startswith("error: TypeError"), outcome  # the preflight failed

    def posts_answered() -> int:
        page.wait_for_timeout(100)  # Playwright hands over its events only inside its calls
        return sum(1 for method, path, _ in traffic if method == "POST" and path.startswith("/v1/"))

    wait_for(lambda: posts_answered() >= len(POSTS_OUT), 30, f"{len(POSTS_OUT)} POSTs answered")
    refused = [(m, p, s) for m, p, s in traffic if not 400 <= s < 500]
    assert refused == [], f"the gateway served a page elsewhere: {refused} ({outcome})"
    ids = [f"{prefix}-{name}" for name in (*POSTS_OUT, "cors_json")] + [f"{prefix}-th"]
    assert_nothing_started(gateway, client, script, prompt, ids)


def test_a_page_at_a_rebound_name_is_refused_on_every_path(page, gateway, client, script) -> None:
    """The attacker's name resolves to the gateway's address once the page has loaded:
    to the browser the gateway is then the page's own origin, so only the Host header
    tells the two apart."""
    prefix = f"rb-{uuid.uuid4().hex[:8]}"
    prompt = script([[tool("alpha", f"echo {prefix}-ran")], text("pwned")])
    origin = f"http://rebind.test:{gateway.port}"
    html = attack_page({"gw": origin, "prefix": prefix, "prompt": prompt, "rebound": True})
    page.route(
        f"{origin}/attack.html", lambda route: route.fulfill(body=html, content_type="text/html")
    )
    page.goto(f"{origin}/attack.html")
    outcome = run_outcome(page)
    status, body = outcome["rebind_post"]
    assert status == 400 and json.loads(body)["error"] == "invalid_host", outcome
    assert outcome["rebind_read"] == outcome["rebind_page"] == 400, outcome
    assert_nothing_started(gateway, client, script, prompt, [f"{prefix}-rebind_post"])


def test_the_viewer_on_the_same_origin_still_runs(page, gateway, client, script) -> None:
    page.goto(gateway.url + "/")
    page.wait_for_selector("#machines li[data-machine=alpha]")
    page.fill("#prompt", script([[tool("alpha", "echo same-origin")], text("viewer ok")]))
    page.click("#run")
    page.wait_for_selector("#status[data-status=DONE]")
    assert page.text_content("#answer") == "viewer ok"
    assert "same-origin" in page.text_content("tr.tool-row[data-machine=alpha] td.output")
