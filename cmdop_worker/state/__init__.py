"""The Redis state layer: key names, the run store, events, cancel, presence.

Owns everything the fleet keeps in Redis and how it is read and written: the key
schema (`keys`), runs (`store`, the one way in; `records`, the run record; `barrier`,
its per-turn barrier and a sequential turn's order; `fence`, writes fenced by a turn's
lease; `lease`, a turn's lock), the Lua scripts' registration (`scripts`), the event
stream and pub/sub
(`events`; `aio_events` reads them from asyncio code), the cancel key and its
watchers (`cancel`), machine presence
(`presence`), the fleet's shared rate limiter (`ratelimit`), the clients and
clock they share (`connect`), the machines' Redis users (`acl`), the records of calls
sent to machines (`sent`), and which queue a broker message really arrived on
(`arrival`).

The only wing that imports redis: the others name its client and errors through
`connect`. May import: `core`, `models`, `config`, `errors`, redis, kombu. Never the
coordinator, the machine side, the model seam or the surfaces (`pyproject.toml`'s
import contracts).
Called by every other wing.
"""
