"""The catalogue does not depend on the fleet, through the session fleet (`alpha`,
`beta`, real workers) and presences written beside them the way a worker writes its
own (`state.presence.announce`): a machine joining and another leaving between turns
leave the request's system and tools blocks byte for byte as they were (and the
prompt cache's prefix with them); a thousand machines online give the same tool block
as two; and routing answers a call to an unknown, departed or tool-lacking machine with
names the model can use instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from cmdop_worker.models import Event, MachinePresence, ToolSpec
from cmdop_worker.state.presence import Heartbeat, announce, leave
from cmdop_worker.surfaces.client import Client, Run

from .machine_runs import calls_then_report, finish, use

pytestmark = pytest.mark.integration

TTL_MS = 120_000


def like_alpha(client: Client, name: str, *extra: ToolSpec) -> MachinePresence:
    """A presence offering what `alpha` offers (and `extra`), under another name."""
    alpha = MachinePresence.model_validate_json(client.redis.get(client.keys.machine("alpha")))
    return alpha.model_copy(update={"machine": name, "pid": 0, "tools": [*alpha.tools, *extra]})


@contextmanager
def online(client: Client, presences: list[MachinePresence]) -> Iterator[None]:
    """Machines online (no worker behind them) until the block ends."""
    for presence in presences:
        announce(client.redis, client.keys, presence, ttl_ms=TTL_MS)
    try:
        yield
    finally:
        for presence in presences:
            leave(client.redis, client.keys, presence.machine)


def blocks(request: dict[str, Any]) -> tuple[str, str]:
    body = request["body"]
    return json.dumps(body["system"]), json.dumps(body["tools"])


def cached_share(request: dict[str, Any]) -> float:
    usage = request["response"]["usage"]
    read = usage["cache_read_input_tokens"]
    return read / (read + usage["cache_creation_input_tokens"] + usage["input_tokens"])


def test_a_machine_joining_and_another_leaving_between_turns_keep_the_prefix(
    client, script
) -> None:
    leaver = Heartbeat(
        client.redis, client.keys, like_alpha(client, "leaver"), ttl_s=5, refresh_s=1
    )
    joiner = Heartbeat(
        client.redis, client.keys, like_alpha(client, "joiner"), ttl_s=5, refresh_s=1
    )
    prompt = script(
        [
            [{"type": "text", "text": "a while"}, use("execute_command", command="sleep 1")],
            [{"type": "text", "text": "who is there"}, use("list_machines")],
            [{"type": "text", "text": "{{results}}"}],
        ]
    )

    def between_turns(_: Run, event: Event) -> None:
        if event.type == "TOOL_START" and event.data["tool"] == "execute_command":
            joiner.start()
            leaver.stop()

    leaver.start()
    try:
        done = finish(client, prompt, between_turns, machine="alpha")
    finally:
        joiner.stop()
        leaver.stop()
    assert done.result.status == "done", done.result
    listed = {m["machine"] for m in json.loads(done.ends[-1].data["output"])}
    assert "joiner" in listed and "leaver" not in listed  # the turns did see the change
    requests = script.requests_for(prompt)
    assert len(requests) == 3
    first, after_change, last = requests
    assert blocks(after_change) == blocks(first) == blocks(last)
    assert cached_share(after_change) >= 0.9, after_change["response"]["usage"]
    # The last request reads back all the one before it sent (the listing is new input).
    before = after_change["response"]["usage"]
    read_back = before["cache_read_input_tokens"] + before["cache_creation_input_tokens"]
    assert last["response"]["usage"]["cache_read_input_tokens"] >= read_back


def test_a_thousand_machines_online_give_the_same_tool_block_as_two(client, script) -> None:
    def tool_block() -> str:
        prompt = script([[{"type": "text", "text": "nothing to do"}]])
        assert finish(client, prompt).result.status == "done"
        (request,) = script.requests_for(prompt)
        return blocks(request)[1]

    with_two = tool_block()
    thousand = [like_alpha(client, f"web-{i:04d}") for i in range(1000)]
    with online(client, thousand):
        assert len(client.machines()) >= 1002
        with_thousand = tool_block()
    assert with_thousand == with_two


def test_a_call_to_an_unknown_or_departed_machine_names_the_closest(client, script) -> None:
    webs = [like_alpha(client, f"web-{i:02d}") for i in range(30)]
    with online(client, [*webs, like_alpha(client, "departed")]):
        leave(client.redis, client.keys, "departed")
        prompt = script(
            calls_then_report(
                use("execute_command", machine="web-100", command="true"),
                use("execute_command", machine="departed", command="true"),
                use("execute_command", machine="zzzzzz", command="true"),
            )
        )
        done = finish(client, prompt)
    assert done.result.status == "done"
    unknown, departed, far = (e.data for e in done.ends_in_call_order())
    assert all(e["is_error"] for e in (unknown, departed, far))
    # Never seen: "unknown", the closest known names; seen, gone: "offline", the closest online.
    assert unknown["status"] == far["status"] == "invalid" and departed["status"] == "offline"
    assert unknown["output"].startswith("unknown machine 'web-100': ")
    closest = unknown["output"].split("closest known names: ")[1].split(", ")
    assert 1 <= len(closest) <= 3 and all(n.startswith("web-") for n in closest)
    assert departed["output"].startswith("machine departed is offline; ")
    assert far["output"] == (
        "unknown machine 'zzzzzz': no machine of that name has ever joined this fleet; "
        "list_machines lists the machines online"
    )


def test_a_call_to_a_machine_lacking_the_tool_names_those_that_have_it(client, script) -> None:
    gpu = ToolSpec(name="gpu_info", description="GPU details.", input_schema={"type": "object"})
    boxes = [like_alpha(client, f"gpu-{i:02d}", gpu) for i in range(12)]
    with online(client, boxes):
        prompt = script(calls_then_report(use("gpu_info", machine="alpha")))
        done = finish(client, prompt)
        (request, _) = script.requests_for(prompt)
    assert "gpu_info" in {t["name"] for t in request["body"]["tools"]}
    (end,) = done.ends
    assert end.data["is_error"] and end.data["machine"] == "alpha"
    named = ", ".join(f"gpu-{i:02d}" for i in range(10))
    assert (
        end.data["output"]
        == f"machine alpha does not offer gpu_info; offered by {named} and 2 more"
    )
