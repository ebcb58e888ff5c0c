"""System context: the static system prefix and the per-turn reminder text.

Owns every sentence the runner adds around the agent's own prompt: identity, critical
tools guidance, inspector links, platform hints (the static prefix) and environment,
target machine, no-tools honesty and the turn counter (the reminder). Called by the
coordinator's request preparation (`coordinator/prepare.py`), which gathers `HostFacts`
at its process edge and hands both results to `build_request`.

The split matters for prompt caching: the system prefix is identical on every turn of
a run, so it sits in the cached part; anything that changes per turn goes in the
reminder, which `build_request` appends after the last cache breakpoint and which is
never stored in history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CACHE_BOUNDARY = "<!-- cmdop:cache-boundary -->"

CRITICAL_TOOLS = (
    "Prefer tools for work: inspect and act through them. Never guess what a command "
    "would print or what a file contains; run the tool and report what it returned."
)
INSPECTOR_LINKS = (
    "When you refer to a file, prefer cmdop:// hrefs (cmdop://<machine>/<absolute path>) "
    "so the client can open it in the inspector."
)
PLATFORM_HINTS = {
    "browser": (
        "The client is a browser session: keep answers compact, use Markdown, and link "
        "files with cmdop:// hrefs instead of pasting long contents."
    ),
    "mobile": (
        "The client is a mobile device with a small screen: answer briefly, avoid wide "
        "tables and long code blocks, and summarise command output."
    ),
    "vps": (
        "The machines are remote servers (VPS): be careful with commands that restart "
        "services, change the firewall or could lock out SSH access; say what you will "
        "do before doing anything disruptive."
    ),
}
NO_TOOLS_HONESTY = (
    "No tools are available this turn: do not invent command output or file contents."
)


@dataclass(frozen=True)
class HostFacts:
    """Facts about the coordinator's host, gathered at the process edge."""

    hostname: str
    os_name: str
    timezone: str
    user: str


def system_prompt(*, agent_prompt: str, platform: str | None) -> list[dict[str, Any]]:
    """The static system prefix as Anthropic text blocks; block 0 carries the breakpoint.

    Nothing about the coordinator that builds it (its host name, OS, user) goes in: a
    run's turns land on any coordinator, and the prefix must stay byte-identical for
    its cache to be read. Those facts are the per-turn reminder's.

    The sections are joined and split at the first `CACHE_BOUNDARY` (an agent prompt may
    contain one): the text before it is block 0, marked `cache_control: ephemeral`; the
    rest, if any, is block 1. The marker itself is never sent.
    """
    sections = [
        "You are CMDOP Operator.",
        agent_prompt.strip(),
        CRITICAL_TOOLS,
        INSPECTOR_LINKS,
        PLATFORM_HINTS.get(platform or "", ""),
    ]
    text = "\n\n".join(section for section in sections if section)
    head, _, tail = text.partition(CACHE_BOUNDARY)
    blocks: list[dict[str, Any]] = [
        {"type": "text", "text": head.strip(), "cache_control": {"type": "ephemeral"}}
    ]
    rest = tail.replace(CACHE_BOUNDARY, "").strip()
    if rest:
        blocks.append({"type": "text", "text": rest})
    return blocks


def turn_reminder(
    *, host: HostFacts, target_machine: str | None, has_tools: bool, turn: int, max_turns: int
) -> str:
    """The per-turn reminder, wrapped in `<system-reminder>` tags."""
    lines: list[str] = []
    if target_machine is None:
        lines.append(f"Environment: OS {host.os_name}, timezone {host.timezone}, user {host.user}.")
    else:
        lines.append(
            f"Your client is asking about {target_machine}; machine-bound tools run there "
            "by default; use ask_machine for a sub-task there."
        )
    if not has_tools:
        lines.append(NO_TOOLS_HONESTY)
    lines.append(f"Turn {turn} of {max_turns}.")
    body = "\n".join(lines)
    return f"<system-reminder>\n{body}\n</system-reminder>"
