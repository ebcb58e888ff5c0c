"""The one way a Lua script reaches Redis: registered once per client, then reused.

Every module of the state layer that runs a script calls `script(client, SOURCE)`
instead of `client.register_script(SOURCE)`: the first call for a client registers the
source (redis-py hashes it and runs it by `EVALSHA`, loading it on a miss), later calls
return the same object. A caller made per turn (a turn's lease) pays no new
registration, and one made per process pays exactly one.

Each script names its keys and arguments in its first lines
(`local turn_key = KEYS[1]`, `local now_ms = tonumber(ARGV[1])`) and uses those names
after, so nobody reviewing it counts positions.
"""

from __future__ import annotations

import threading
import weakref

import redis
from redis.commands.core import Script

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
