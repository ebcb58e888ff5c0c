"""Request building: shape, cache breakpoints, and a byte-stable prefix across turns."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmdop_worker.core.catalog import fleet_catalog, resolve_tools
from cmdop_worker.core.context import HostFacts, system_prompt, turn_reminder
from cmdop_worker.core.history import sanitize_history
from cmdop_worker.core.request import (
    MAX_CACHE_BREAKPOINTS,
    build_request,
    cache_breakpoint_count,
    cache_prefix,
    cacheable_share,
)
from cmdop_worker.models import MachinePresence, Message, ToolSpec

HOST = HostFacts(hostname="coord", os_name="Linux", timezone="UTC", user="ops")
SYSTEM = system_prompt(agent_prompt="Operate the fleet.", platform=None)
SHELL = ToolSpec(
    name="shell",
    description="Run a shell command on a machine and return its output.",
    input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}},
)
EPHEMERAL = {"type": "ephemeral"}


def build(history: list[Message], **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "system": SYSTEM,
        "reminder": "<system-reminder>\nTurn 1 of 10.\n</system-reminder>",
        "history": history,
        "tools": [SHELL],
        "temperature": 0.3,
        "max_tokens": 1024,
    }
    args.update(kw)
    return build_request(**args)


def marked_positions(request: dict[str, Any]) -> list[tuple[int, int]]:
    return [
        (m_index, b_index)
        for m_index, message in enumerate(request["messages"])
        for b_index, block in enumerate(message["content"])
        if "cache_control" in block
    ]


CONVERSATION = [
    Message(role="user", content="check the disks"),
    Message(
        role="assistant",
        content=[{"type": "tool_use", "id": "t1", "name": "shell", "input": {"cmd": "df"}}],
    ),
    Message(role="user", content=[{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]),
    Message(role="assistant", content="Disks are fine."),
    Message(role="user", content="and memory?"),
]


def test_request_shape() -> None:
    request = build(CONVERSATION)
    assert request["model"] == "claude-sonnet-4-5"
    assert request["max_tokens"] == 1024
    assert request["system"] == SYSTEM
    assert request["tools"] == [
        {"name": "shell", "description": SHELL.description, "input_schema": SHELL.input_schema}
    ]
    assert request["tool_choice"] == {"type": "auto"}
    assert request["extra_body"] == {"temperature": 0.3}
    assert "temperature" not in request
    json.dumps(request)  # plain data only


@pytest.mark.parametrize(
    ("temperature", "tools", "expected_keys"),
    [
        (0.3, [SHELL], {"extra_body", "tools", "tool_choice"}),
        (None, [SHELL], {"tools", "tool_choice"}),
        (0.0, [], {"extra_body"}),
        (None, [], set()),
    ],
)
def test_optional_keys(
    temperature: float | None, tools: list[ToolSpec], expected_keys: set[str]
) -> None:
    request = build(CONVERSATION, temperature=temperature, tools=tools)
    base = {"model", "max_tokens", "system", "messages"}
    assert set(request) == base | expected_keys


def test_breakpoints_at_documented_positions() -> None:
    request = build(CONVERSATION)
    # Last user message (index 4) before the reminder, and the previous user message (2).
    assert marked_positions(request) == [(2, 0), (4, 0)]
    assert request["system"][0]["cache_control"] == EPHEMERAL
    assert cache_breakpoint_count(request) == 3


def test_single_user_message_gets_one_history_breakpoint() -> None:
    request = build([Message(role="user", content="hi")])
    assert marked_positions(request) == [(0, 0)]
    assert request["messages"][0]["content"][0] == {
        "type": "text",
        "text": "hi",
        "cache_control": EPHEMERAL,
    }


def test_reminder_is_last_unmarked_and_not_in_history() -> None:
    history = copy.deepcopy(CONVERSATION)
    before = [m.model_dump() for m in history]
    request = build(history, reminder="<system-reminder>now</system-reminder>")
    last = request["messages"][-1]["content"][-1]
    assert last == {"type": "text", "text": "<system-reminder>now</system-reminder>"}
    assert [m.model_dump() for m in history] == before
    assert "system-reminder" not in json.dumps(before)


def test_blank_reminder_is_not_sent() -> None:
    request = build(CONVERSATION, reminder="  ")
    assert request["messages"][-1]["content"] == [
        {"type": "text", "text": "and memory?", "cache_control": EPHEMERAL}
    ]


def test_reminder_goes_to_last_user_message_before_a_prefill() -> None:
    history = [*CONVERSATION, Message(role="assistant", content="Memory is")]
    request = build(history)
    assert request["messages"][-2]["content"][-1]["text"].startswith("<system-reminder>")
    assert marked_positions(request) == [(2, 0), (4, 0)]


def test_history_without_user_message_is_rejected() -> None:
    with pytest.raises(ValueError, match="no user message"):
        build([])


def test_breakpoint_budget_never_exceeded() -> None:
    marked = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(6)]
    request = build(CONVERSATION, system=marked)
    assert cache_breakpoint_count(request) == MAX_CACHE_BREAKPOINTS
    assert marked_positions(request) == []
    three = build(CONVERSATION, system=marked[:3])
    assert marked_positions(three) == [(4, 0)]  # the newest position wins the last slot
    assert all("cache_control" in b for b in marked)  # caller's blocks untouched


def test_markers_stored_in_history_are_stripped() -> None:
    block = {"type": "text", "text": "old", "cache_control": EPHEMERAL}
    nested = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "x", "cache_control": EPHEMERAL}],
    }
    history = [
        Message(role="user", content=[block, {"type": "text", "text": "more"}]),
        Message(
            role="assistant",
            content=[{"type": "tool_use", "id": "t1", "name": "shell", "input": {}}],
        ),
        Message(role="user", content=[nested, {"type": "text", "text": "go"}]),
    ]
    request = build(history)
    assert cache_breakpoint_count(request) == 3
    assert "cache_control" not in request["messages"][2]["content"][0]["content"][0]
    assert history[0].content[0] == block


def test_input_not_mutated() -> None:
    """Deep copy before, compare after: markers stripped, placed and the reminder added
    only on copies, with and without the breakpoint budget spent on the system prefix."""
    nested = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "x", "cache_control": EPHEMERAL}, "raw"],
        "cache_control": EPHEMERAL,
    }
    history = [
        *CONVERSATION[:3],
        Message(role="user", content=[{"type": "text", "text": "old", "cache_control": {}}]),
        Message(role="assistant", content=[use_block("t1")]),
        Message(role="user", content=[nested, {"type": "text", "text": "go"}]),
    ]
    system = [dict(block) for block in SYSTEM]
    before, system_before = copy.deepcopy(history), copy.deepcopy(system)
    for system_blocks in (system, system * 4):
        request = build(history, system=system_blocks)
        assert history == before
        assert [m.model_dump() for m in history] == [m.model_dump() for m in before]
        assert system == system_before
        mark_marked_blocks(request)  # blocks that carry a breakpoint are copies
        assert history == before


def mark_marked_blocks(request: dict[str, Any]) -> None:
    for message in request["messages"]:
        for block in message["content"]:
            if "cache_control" in block:
                block["cache_control"]["mutated"] = True
                block["mutated"] = True


def use_block(call_id: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "shell", "input": {"cmd": "df"}}


marker = st.sampled_from([{}, {"cache_control": EPHEMERAL}])
inner = st.one_of(st.just("plain"), st.builds(lambda m: {"type": "text", "text": "i", **m}, marker))
blocks = st.one_of(
    st.builds(lambda m: {"type": "text", "text": "t", **m}, marker),
    st.builds(lambda m: {**use_block("t1"), **m}, marker),
    st.builds(
        lambda c, m: {"type": "tool_result", "tool_use_id": "t1", "content": c, **m},
        st.just("out") | st.lists(inner, max_size=3),
        marker,
    ),
)
messages = st.builds(
    Message,
    role=st.sampled_from(["user", "assistant"]),
    content=st.just("hi") | st.lists(blocks, min_size=1, max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.integers(0, 5))
def test_build_request_never_mutates_history(history: list[Message], system_marks: int) -> None:
    history = [Message(role="user", content="start"), *history]
    system = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(6)]
    before = copy.deepcopy(history)
    request = build(history, system=system[:system_marks] or SYSTEM)
    assert history == before
    assert cache_breakpoint_count(request) <= MAX_CACHE_BREAKPOINTS
    mark_marked_blocks(request)
    assert history == before


# --- caching across a run ----------------------------------------------------------


def fleet_tools() -> list[ToolSpec]:
    specs = [
        ToolSpec(
            name=name,
            description=f"{name}: " + "does useful work on the machine. " * 12,
            input_schema={
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "the argument " * 6}},
                "required": ["arg"],
            },
        )
        for name in ("shell", "read_file", "write_file", "list_dir", "ps", "df")
    ]
    presences = [
        MachinePresence(machine=m, host=m, pid=1, started_ms=0, tools=specs)
        for m in ("vps-a", "vps-b")
    ]
    return fleet_catalog(presences, [])


def run_requests(turns: int) -> list[dict[str, Any]]:
    tools = resolve_tools(fleet_tools(), turn=1, tool_tags=None, hidden=frozenset())
    system = system_prompt(agent_prompt="Operate the fleet. " * 40, platform="vps")
    history = [Message(role="user", content="Check every machine's disks and memory.")]
    requests = []
    for turn in range(1, turns + 1):
        reminder = turn_reminder(
            host=HOST, target_machine=None, has_tools=True, turn=turn, max_turns=turns
        )
        requests.append(
            build_request(
                model="claude-sonnet-4-5",
                system=system,
                reminder=reminder,
                history=sanitize_history(history),
                tools=tools,
                temperature=0.3,
                max_tokens=1024,
            )
        )
        call_id = f"toolu_{turn:02d}"
        history.append(
            Message(
                role="assistant",
                content=[
                    {"type": "text", "text": f"Checking step {turn}."},
                    {"type": "tool_use", "id": call_id, "name": "shell", "input": {"arg": "df"}},
                ],
            )
        )
        output = f"Filesystem {turn} 42% used\n" * 3
        history.append(
            Message(
                role="user",
                content=[{"type": "tool_result", "tool_use_id": call_id, "content": output}],
            )
        )
    return requests


def full_bytes(request: dict[str, Any]) -> bytes:
    # Full canonical serialisation = the prefix of a request whose every block is marked.
    marked = copy.deepcopy(request)
    for message in marked["messages"]:
        for block in message["content"]:
            block["cache_control"] = EPHEMERAL
    return cache_prefix(marked)


def test_prefix_is_byte_identical_turn_to_turn() -> None:
    requests = run_requests(10)
    for previous, current in itertools.pairwise(requests):
        prefix = cache_prefix(previous)
        assert prefix, "every request has a breakpoint"
        assert full_bytes(current).startswith(prefix)
        # The previous breakpoint sits exactly where the current request puts its second.
        assert cache_prefix(current).startswith(prefix)
        assert cache_breakpoint_count(current) <= MAX_CACHE_BREAKPOINTS


def test_prefix_covers_all_history_but_not_the_reminder() -> None:
    request = run_requests(3)[-1]
    prefix = cache_prefix(request).decode()
    assert "toolu_02" in prefix
    assert "system-reminder" not in prefix
    assert "system-reminder" in full_bytes(request).decode()


def dumped_pieces(request: dict[str, Any]) -> tuple[list[str], int]:
    """Independent of `cache_prefix`: json.dumps(sort_keys=True) of tools, system, then
    each message's role and blocks, markers stripped; plus the index of the last marked
    piece."""
    pieces: list[str] = []
    last_marked = -1

    def add(piece: dict[str, Any]) -> None:
        nonlocal last_marked
        if "cache_control" in piece:
            last_marked = len(pieces)
        pieces.append(
            json.dumps({k: v for k, v in piece.items() if k != "cache_control"}, sort_keys=True)
        )

    for piece in [*request.get("tools", []), *request["system"]]:
        add(piece)
    for message in request["messages"]:
        add({"role": message["role"]})
        for block in message["content"]:
            add(block)
    return pieces, last_marked


def test_ten_turns_share_a_byte_identical_prefix_up_to_the_last_breakpoint() -> None:
    requests = run_requests(10)
    for previous, current in itertools.pairwise(requests):
        before, last = dumped_pieces(previous)
        after, _ = dumped_pieces(current)
        history_start = len(previous["tools"]) + len(previous["system"])
        assert last > history_start, "the last breakpoint is in history"
        assert after[: last + 1] == before[: last + 1]
        assert "system-reminder" in before[last + 1]  # only the reminder follows it


def test_cacheable_share_grows_with_the_run() -> None:
    requests = run_requests(10)
    shares = [cacheable_share(a, b) for a, b in itertools.pairwise(requests)]
    assert all(0.0 < share <= 1.0 for share in shares)
    assert shares[-1] > 0.8
    assert shares[-1] >= shares[0]


def test_cacheable_share_is_zero_when_tools_change() -> None:
    first, second = run_requests(2)
    changed = copy.deepcopy(second)
    changed["tools"][0]["description"] += " (changed)"
    assert cacheable_share(first, changed) == 0.0
    assert cacheable_share(first, second) > 0.5


def test_cacheable_share_of_identical_requests_is_whole_prefix() -> None:
    (request,) = run_requests(1)
    share = cacheable_share(request, request)
    assert share == len(cache_prefix(request)) / len(full_bytes(request))
