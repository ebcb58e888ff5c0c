"""Reading one machine's presence JSON (`presence`, and the worker checking who holds
its name at start): fields this version does not know are ignored, an unreadable one
is reported and left out, and each distinct JSON is parsed once.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from cmdop_worker.models import MachinePresence, ToolSpec

log = logging.getLogger(__name__)


def parse_presence(raw: str | bytes, *, source: str) -> MachinePresence | None:
    """A presence, ignoring fields this version does not know (a newer worker may add
    some); None, with a warning, when it is unreadable. Every coordinator turn reads
    all presences, so one bad key must not stop the fleet."""
    try:
        return _parsed_presence(raw)
    except (ValueError, AttributeError) as exc:  # ValidationError is a ValueError
        log.warning("ignoring unreadable machine presence %s: %s", source, exc)
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
    return MachinePresence.model_validate(known)


def _known_tool_fields(spec: Any) -> Any:
    if not isinstance(spec, dict):
        return spec
    return {k: v for k, v in spec.items() if k in ToolSpec.model_fields}
