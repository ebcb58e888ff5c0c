"""The one way a Lua script reaches Redis: registered once per client, then reused.

Every module of the state layer that runs a script calls `script(client, SOURCE)`
instead of `client.register_script(SOURCE)`: the first call for a client registers the
source (redis-py hashes it and runs it by `EVALSHA`, loading it on a miss), later calls
return the same object. A caller made per turn (a turn's lease) pays no new
registration, and one made per process pays exactly one.

Each script names its keys and arguments in its first lines
(`local turn_key = KEYS[1]`, `local now_ms = tonumber(ARGV[1])`) and uses those names
after, so nobody reviewing it counts positions. Its caller passes them through
`run_script` as dicts in the same order and under the same names, so the order is
written once on each side and the two read side by side.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import redis
from redis.commands.core import Script

# What a script's argument may be (redis-py encodes it as text).
ScriptArg: TypeAlias = str | bytes | int | float

_registered: weakref.WeakKeyDictionary[redis.Redis, dict[str, Script]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # the lease renewer and a turn's thread may ask at once


def script(client: redis.Redis, source: str) -> Script:
    """`source` registered with `client`, once per client."""
    with _lock:
        known = _registered.setdefault(client, {})
        found = known.get(source)
        if found is None:
            found = known[source] = client.register_script(source)
        return found


def run_script(
    client: redis.Redis,
    source: str,
    *,
    keys: Mapping[str, str],
    args: Mapping[str, ScriptArg],
    more_keys: Iterable[str] = (),
    more_args: Iterable[ScriptArg] = (),
) -> Any:
    """Run `source` with `keys` and `args` in their order (named as the script's header
    names them), then `more_keys` and `more_args`, a variable tail the script walks."""
    return script(client, source)(
        keys=[*keys.values(), *more_keys], args=[*args.values(), *more_args]
    )
