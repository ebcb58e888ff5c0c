"""System prefix and per-turn reminder text."""

from __future__ import annotations

import pytest

from cmdop_worker.core.context import (
    CACHE_BOUNDARY,
    NO_TOOLS_HONESTY,
    PLATFORM_HINTS,
    HostFacts,
    system_prompt,
    turn_reminder,
)

HOST = HostFacts(hostname="coord-1", os_name="Linux", timezone="Europe/Berlin", user="ops")


def test_system_prompt_single_cached_block() -> None:
    blocks = system_prompt(agent_prompt="Be terse.", platform=None)
    assert len(blocks) == 1
    (block,) = blocks
    assert block["type"] == "text"
    assert block["cache_control"] == {"type": "ephemeral"}
    body = block["text"]
    assert body.startswith("You are CMDOP Operator.")
    assert "Be terse." in body
    assert "never guess what a command would print" in body.lower()
    assert "cmdop://" in body
    assert not any(hint in body for hint in PLATFORM_HINTS.values())


@pytest.mark.parametrize("platform", ["browser", "mobile", "vps"])
def test_platform_hints(platform: str) -> None:
    (block,) = system_prompt(agent_prompt="x", platform=platform)
    assert PLATFORM_HINTS[platform] in block["text"]
    others = [hint for name, hint in PLATFORM_HINTS.items() if name != platform]
    assert not any(hint in block["text"] for hint in others)


def test_unknown_platform_has_no_hint() -> None:
    plain = system_prompt(agent_prompt="x", platform=None)
    assert system_prompt(agent_prompt="x", platform="toaster") == plain


def test_split_at_cache_boundary() -> None:
    prompt = f"Static rules.\n{CACHE_BOUNDARY}\nToday's rota: Alice."
    blocks = system_prompt(agent_prompt=prompt, platform="vps")
    assert len(blocks) == 2
    assert "Static rules." in blocks[0]["text"]
    assert blocks[0]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in blocks[1]
    assert blocks[1]["text"].startswith("Today's rota: Alice.")
    assert PLATFORM_HINTS["vps"] in blocks[1]["text"]
    assert all(CACHE_BOUNDARY not in b["text"] for b in blocks)


def test_system_prompt_is_deterministic_and_has_no_empty_blocks() -> None:
    first = system_prompt(agent_prompt=f"{CACHE_BOUNDARY}", platform=None)
    assert first == system_prompt(agent_prompt=f"{CACHE_BOUNDARY}", platform=None)
    assert all(b["text"].strip() for b in first)


def reminder(**kw: object) -> str:
    args: dict[str, object] = {
        "host": HOST,
        "target_machine": None,
        "has_tools": True,
        "turn": 2,
        "max_turns": 10,
    }
    args.update(kw)
    return turn_reminder(**args)  # type: ignore[arg-type]


def test_reminder_wrapped_and_counts_turns() -> None:
    text = reminder()
    assert text.startswith("<system-reminder>")
    assert text.endswith("</system-reminder>")
    assert "Turn 2 of 10." in text


def test_reminder_environment_only_without_target() -> None:
    local = reminder()
    assert "Linux" in local and "Europe/Berlin" in local and "ops" in local
    remote = reminder(target_machine="vps-foo")
    assert "Linux" not in remote and "Europe/Berlin" not in remote and "ops" not in remote
    assert (
        "Your client is asking about vps-foo; machine-bound tools run there by default; "
        "use ask_machine for a sub-task there."
    ) in remote
    assert "asking about" not in local


@pytest.mark.parametrize(("has_tools", "honesty"), [(True, False), (False, True)])
def test_no_tools_honesty(has_tools: bool, honesty: bool) -> None:
    assert (NO_TOOLS_HONESTY in reminder(has_tools=has_tools)) is honesty
    assert NO_TOOLS_HONESTY == (
        "No tools are available this turn: do not invent command output or file contents."
    )


def test_the_system_prefix_names_nothing_of_the_coordinator_it_was_built_on() -> None:
    # Turns of one run land on any coordinator: the cached prefix must not change.
    blocks = system_prompt(agent_prompt="Operate.", platform="vps")
    text = "\n".join(b["text"] for b in blocks)
    for fact in (HOST.hostname, HOST.os_name, HOST.timezone, HOST.user):
        assert fact not in text
    assert f"OS {HOST.os_name}" in reminder()
