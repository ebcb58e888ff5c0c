"""Our Prometheus metrics, scraped from real worker processes."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cmdop_worker.config import Settings
from cmdop_worker.surfaces.client import Client
from cmdop_worker.surfaces.fleet import LocalFleet, free_port

pytestmark = pytest.mark.integration


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_workers_export_turn_model_tool_retry_and_cancel_metrics(
    fleet_env, redis_server, fake_model, script, tmp_path
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/2"  # own database: own queues
    coordinator_port, machine_port = free_port(), free_port()
    local = LocalFleet({**fleet_env, "CMDOP_REDIS_URL": url}, logdir=tmp_path)
    try:
        local.start_coordinator(extra_env={"CMDOP_METRICS_PORT": str(coordinator_port)})
        local.start_machine("alpha", {"CMDOP_METRICS_PORT": str(machine_port)})
        local.wait_ready(["alpha"], timeout_s=60)
        with Client(Settings(redis_url=url)) as client:
            call = {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "alpha", "command": "true"},
            }
            fake_model.inject({"status": 529})
            client.submit(prompt=script([[call], [{"type": "text", "text": "ok"}]])).wait(
                timeout=30
            )
            slow = {
                "type": "tool_use",
                "name": "execute_command",
                "input": {"machine": "alpha", "command": "sleep 30"},
            }
            run = client.submit(prompt=script([[slow], [{"type": "text", "text": "never"}]]))
            for event in run.events():
                if event.type == "TOOL_START":
                    run.cancel(ui=True)
                    break
            run.wait(timeout=30, raise_on_failure=False)
        time.sleep(0.5)  # the machine's cancelled tool records its duration as it exits
        coordinator, machine = scrape(coordinator_port), scrape(machine_port)
    finally:
        local.stop()

    assert coordinator[("cmdop_turn_seconds_count", ())] >= 3
    assert coordinator[("cmdop_model_call_seconds_count", (("outcome", "ok"),))] >= 3
    assert coordinator[("cmdop_model_retries_total", (("cause", "http_529"),))] == 1
    assert (
        coordinator[("cmdop_runs_ended_total", (("status", "done"), ("stop_reason", "end_turn")))]
        == 1
    )
    assert coordinator[("cmdop_cancels_total", (("channel", "ui"),))] == 1
    assert (
        machine[("cmdop_tool_seconds_count", (("status", "ok"), ("tool", "execute_command")))] == 1
    )
