"""The Redis state layer: key names, the run store, events, cancel, presence.

Owns everything the fleet keeps in Redis and how it is read and written: the key
schema (`keys`), runs (`store`, the façade; `records`, the run record; `barrier`, the
per-turn barrier and a sequential turn's order; `fence`, writes fenced by a turn's
lease), the event stream and pub/sub
(`events`; `aio_events` reads them from asyncio code), the cancel key and its
watchers (`cancel`), machine presence
(`presence`), the fleet's shared rate limiter (`ratelimit`), and the clients and
clock they share (`connect`).

May import: `core`, `models`, `config`, `errors`, redis. Never the coordinator, the
machine side, the model seam or the surfaces (`pyproject.toml`'s import contracts).
Called by every other wing.
"""
