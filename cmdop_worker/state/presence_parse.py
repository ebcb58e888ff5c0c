"""Reading one machine's presence JSON (`presence`, and the worker checking who holds
its name at start): fields this version does not know are ignored, an unreadable one
is reported and left out, and each distinct JSON is parsed once. Also the fleet's
version as a reader may trust it (`parse_version`).

What a reader finds in the fleet-wide presence keys was written by machines, any of
which may be compromised: a presence naming another machine than its key (`claimed`)
is left out, and a version that is no whole number is taken for unknown.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, TypeGuard

from cmdop_worker.models import (
    MachinePresence,
    ToolSpec,
    label_key_problem,
    label_value_problem,
)

log = logging.getLogger(__name__)

_VERSION_LIMIT = 2**53  # the scripts count in Lua's doubles: exact below this
# Far above any worker's (its tools' schemas, ~10 KB for the built-ins): what a
# machine may make every reader parse.
PRESENCE_MAX_BYTES = 1_000_000
_misnamed: set[tuple[str, str]] = set()  # (key, name claimed) already reported


def parse_version(raw: str | bytes | None) -> str | None:
    """The fleet's version as a reader may hold and compare it (a whole number, written
    canonically); None, unknown, for anything else (absent, or not a version: a machine's
    credentials may write anything there). A snapshot at an unknown version is never
    caught up from, so the next read reads everything again."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if text is None or not (text.isascii() and text.isdigit()):
        return None
    number = int(text)
    return str(number) if number < _VERSION_LIMIT else None


def claimed(
    presence: MachinePresence | None, machine: str, *, source: str
) -> TypeGuard[MachinePresence]:
    """Whether `presence`, read from `machine`'s key, names that machine: one written
    under another name (a machine passing itself off as another, with the labels and
    tools it likes) is left out, with a warning once per key and name."""
    if presence is None or presence.machine == machine:
        return presence is not None
    if (source, presence.machine) not in _misnamed and len(_misnamed) < 4096:
        _misnamed.add((source, presence.machine))
        log.warning(
            "ignoring machine presence %s: it names machine %r, not %r",
            source,
            presence.machine,
            machine,
        )
    return False


def parse_presence(raw: str | bytes, *, source: str) -> MachinePresence | None:
    """A presence, ignoring fields this version does not know (a newer worker may add
    some); None, with a warning, when it is unreadable. Every coordinator turn reads
    all presences, so one bad key must not stop the fleet."""
    if len(raw) > PRESENCE_MAX_BYTES:
        log.warning(
            "ignoring machine presence %s: %d bytes, over %d", source, len(raw), PRESENCE_MAX_BYTES
        )
        return None
    try:
        return _parsed_presence(raw)
    except Exception as exc:  # written by a machine: any JSON at all (nesting, types)
        log.warning("ignoring unreadable machine presence %s: %s", source, str(exc)[:200])
        return None


@functools.lru_cache(maxsize=16_384)
def _parsed_presence(raw: str | bytes) -> MachinePresence:
    """A worker's presence stays the same JSON while it lives: parsed once (the result
    is immutable; a failure is not cached, so it is reported every time)."""
    data = json.loads(raw)
    known = {k: v for k, v in data.items() if k in MachinePresence.model_fields}
    tools = known.get("tools")
    if isinstance(tools, list):
        known["tools"] = [_known_tool_fields(t) for t in tools]
    presence = MachinePresence.model_validate(known)
    for key, value in presence.labels.items():  # as `--label` would have checked them
        problem = label_key_problem(key) or label_value_problem(value)
        if problem:
            raise ValueError(f"label {key[:63]!r}: {problem}")
    return presence


def _known_tool_fields(spec: Any) -> Any:
    if not isinstance(spec, dict):
        return spec
    return {k: v for k, v in spec.items() if k in ToolSpec.model_fields}
