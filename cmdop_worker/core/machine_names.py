"""Machine names the fleet knows: what to say about a name it has never seen, or one it
knows but is offline now.

The fleet remembers every machine name it has seen (`state.seen`, key `machines:seen`).
A name never seen is most likely a typo: a run or call naming one is refused, and the
refusal names the closest known names. A name seen before but offline now is accepted
where it may come back (a run's target machine), with a warning saying when it was
last seen. Used at submit (`surfaces.client`, the gateway) and by routing
(`core.routing`, a call the model makes). Pure: names, times and the clock come in as
arguments.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection

CLOSEST_AT_MOST = 3
_CUTOFF = 0.5  # difflib's similarity below which a name is not offered


def closest_names(machine: str, names: Collection[str], *, n: int = CLOSEST_AT_MOST) -> list[str]:
    """The names most like `machine`, best first (at most `n`; none when none is close)."""
    return difflib.get_close_matches(machine, list(names), n=n, cutoff=_CUTOFF)


MODEL_HINT = "list_machines lists the machines online"
PERSON_HINT = "cmdop-worker machines --all lists every known machine"


def unknown_machine(
    machine: str, known: Collection[str], online: Collection[str], *, hint: str = MODEL_HINT
) -> str:
    """Why `machine` is refused: never seen by this fleet; the closest known names, each
    marked when it is offline now, or else `hint` (the model's, or `PERSON_HINT`)."""
    said = f"unknown machine '{machine}': no machine of that name has ever joined this fleet"
    if not known:
        return f"{said}; no machine has joined it yet"
    closest = closest_names(machine, known)
    if not closest:
        return f"{said}; {hint}"
    shown = ", ".join(name if name in online else f"{name} (offline)" for name in closest)
    return f"{said}; closest known names: {shown}"


def offline_warning(machine: str, last_seen_ms: int | None, now_ms: int) -> str:
    """What a request for a known machine that is offline now is told: it is accepted,
    and its calls wait for nobody (each is answered "offline" until it is back)."""
    seen = "" if last_seen_ms is None else f" (last seen {ago(now_ms - last_seen_ms)} ago)"
    return f"machine '{machine}' is offline{seen}; its tool calls fail until it is back"


def ago(elapsed_ms: int) -> str:
    """A duration, as a person reads it: 42s, 7m, 3h, 12d."""
    seconds = max(elapsed_ms, 0) // 1000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def name_held(machine: str, host: str, pid: int) -> str:
    """Why a machine worker does not start: its name is held by a live worker (one
    name, one worker), and how to go on."""
    return (
        f"machine name '{machine}' is held by a live worker on host {host} (pid {pid}); "
        "one name is served by one worker: stop that one, start this one under another "
        "name, or take the name over with --take-over (CMDOP_MACHINE_TAKE_OVER=1)"
    )
