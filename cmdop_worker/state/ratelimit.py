"""The fleet's one rate limiter: a bucket per account and model, shared in Redis.

Every coordinator calling a model draws from the same hash (`Keys.ratelimit(scope)`,
scope = `core.ratelimit.limiter_scope`), through one Lua script, so the limiter is a
single decision however many processes ask. It keeps, per dimension (requests, input
tokens, output tokens), a GCRA cell: the bucket's capacity (the provider's stated
`limit`), the milliseconds one unit takes to come back (`t`), and the theoretical
arrival time (`tat`, the time the bucket is full again: exactly what the provider's
`reset` header says). The script's clock is Redis's own `TIME`, one clock for all.

- `acquire` reserves a call's cost and says how long to wait first. Request slots are
  handed out one pace apart (`core.ratelimit.paced_slot`: the per-minute interval,
  slowed a little), however full the bucket: the API enforces its per-minute limit over
  short intervals too, so a burst the bucket would allow still meets 429s. Callers get
  successive slots, never one shared wake-up time, so a fleet released from a wait does
  not herd. A caller that waited comes back with the `epoch` it was given: unchanged,
  its slot stands; changed (a 429 or 529 since), it queues again. A small headroom of
  each bucket is never planned for. Tokens are held by their buckets, not paced (a
  call's input is only estimated before it is made, cache reads included). Before any
  limit is known, one call at a time goes as a probe (`reason` "probe", no wait);
  endpoints that send no limits at all are let through once that is seen.
- `learn` takes what a response said: capacity, remaining and reset per dimension
  (`tat` only ever moves later: the provider's view includes other clients; the
  interval per unit only moves up, each reading being a lower bound, until the limit
  itself changes), and a pause after a 429 or 529 — every coordinator holds off until
  it ends, then one request per pace. With a call's correction (what it drew minus what
  it reserved) it settles that call in the same round trip.
- `settle` corrects a reservation alone (a call never made gives it all back). The
  pace is never moved back: a slot given back would land on one already handed out.

Called by the model seam (`llm.limiter`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

import redis

from cmdop_worker.core.ratelimit import DIMENSIONS, PACE_MARGIN, Allowance, Cost, Dimension
from cmdop_worker.state.keys import Keys
from cmdop_worker.state.scripts import script

PROBE_MS = 2_000  # how long a first call may hold the others back before another probes
PROBE_POLL_MS = 50
IDLE_TTL_MS = 600_000  # a scope nobody called for this long is forgotten

# One script, three ops (`op`); its header lays out every op's arguments, and each op
# reads its own by those names.
_LIMITER_LUA = """
-- ARGV: op, ttl_ms, then the op's own arguments from OWN on (empty text: none):
--   acquire: cost per dimension (r, i, o), the epoch held, probe_ms, probe_poll_ms,
--            pace_factor (`core.ratelimit.pace_ms`)
--   learn:   limit, remaining, reset_ms per dimension (STATED each), then pause_ms,
--            then a settled call's correction per dimension (r, i, o)
--   settle:  delta per dimension
local key = KEYS[1]
local op, ttl_ms = ARGV[1], tonumber(ARGV[2])
local OWN = 3
local STATED = 3
local dims = {'r', 'i', 'o'}
-- `count` arguments from `first` on, as numbers (nil where empty).
local function numbers(first, count)
  local out = {}
  for n = 1, count do out[n] = tonumber(ARGV[first + n - 1]) end
  return out
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local h = {}
local raw = redis.call('HGETALL', key)
for n = 1, #raw, 2 do h[raw[n]] = tonumber(raw[n + 1]) end
local function put(name, value)
  h[name] = value
  redis.call('HSET', key, name, string.format('%.17g', value))
end
local function cell(d)
  local cap, t = h[d .. ':cap'], h[d .. ':t']
  if cap == nil or t == nil then return nil end
  local room = math.min(math.max(1, cap * 0.02), cap - 1)
  return {cap = cap, t = t, tat = math.max(h[d .. ':tat'] or now, now), tau = (cap - room) * t,
          most = cap - room}
end
-- Move each bucket by `deltas` units (negative: give them back); never the pace.
local function settle(deltas)
  for n, d in ipairs(dims) do
    local c, delta = cell(d), deltas[n]
    if c ~= nil and delta ~= nil and delta ~= 0 then
      put(d .. ':tat', math.max(c.tat + delta * c.t, now))
    end
  end
end
local epoch = h['epoch'] or 0

if op == 'acquire' then
  local costs = numbers(OWN, #dims)
  local held, probe_ms, probe_poll_ms, pace_factor = unpack(numbers(OWN + #dims, 4), 1, 4)
  if held ~= nil and held == epoch then return {0, epoch, 'go'} end
  local pause = h['pause'] or 0
  if pause > now then return {math.ceil(pause - now), epoch, 'pause'} end
  local at, cells = now, {}
  for n, d in ipairs(dims) do
    local c = cell(d)
    if c ~= nil then
      c.cost = math.min(costs[n], c.most)
      cells[d] = c
      at = math.max(at, c.tat + c.cost * c.t - c.tau)
    end
  end
  if next(cells) == nil then
    if (h['bare'] or 0) > now then return {0, epoch, 'go'} end
    local probe = h['probe'] or 0
    if probe > now then
      return {math.ceil(math.min(probe - now, probe_poll_ms)), epoch, 'probe'}
    end
    put('probe', now + probe_ms)
    put('probed', now)
    redis.call('PEXPIRE', key, ttl_ms)
    return {0, epoch, 'probe'}
  end
  local r = cells['r']
  if r ~= nil and r.cost > 0 then
    -- One request per pace, however full the bucket (`core.ratelimit.paced_slot`);
    -- the first after the probe one pace after it.
    local probed = h['probed'] and h['probed'] + r.t * pace_factor
    at = math.max(at, h['r:pace'] or probed or now)
    put('r:pace', at + r.t * pace_factor)
  end
  for d, c in pairs(cells) do put(d .. ':tat', math.max(c.tat, at) + c.cost * c.t) end
  redis.call('PEXPIRE', key, ttl_ms)
  if at <= now then return {0, epoch, 'go'} end
  return {math.ceil(at - now), epoch, 'pace'}
end

if op == 'learn' then
  local function stated_of(n)
    return unpack(numbers(OWN + (n - 1) * STATED, STATED), 1, STATED)
  end
  local pause_ms = tonumber(ARGV[OWN + #dims * STATED])
  local stated = false
  for n, d in ipairs(dims) do
    local cap, left, reset = stated_of(n)
    if cap ~= nil and cap > 0 then
      stated = true
      local t = h[d .. ':t']
      -- A new limit (or a guess): its interval is learnt anew.
      if h[d .. ':cap'] ~= cap or h[d .. ':guess'] == 1 then t = nil end
      local seen = nil  -- `core.ratelimit.unit_ms_bound`: never more than the truth
      if reset ~= nil and reset > 0 and left < cap then seen = reset / (cap - left) end
      if seen ~= nil and (t == nil or seen > t) then
        t = seen
        put(d .. ':guess', 0)
      elseif t == nil then
        t = 60000 / cap  -- the API states limits per minute
        put(d .. ':guess', 1)
      end
      put(d .. ':cap', cap)
      put(d .. ':t', t)
      if reset ~= nil then put(d .. ':tat', math.max(h[d .. ':tat'] or now, now + reset)) end
    end
  end
  if stated then
    redis.call('HDEL', key, 'probe', 'bare')
  elseif pause_ms == nil then
    put('bare', now + 60000)
  end
  if pause_ms ~= nil then
    local ends = now + pause_ms
    put('pause', math.max(h['pause'] or 0, ends))
    put('epoch', epoch + 1)
    local c = cell('r')
    -- Empty until the pause ends, then one slot at a time: no burst after it. The
    -- slots reserved before are void (the epoch moved): their callers queue again.
    if c ~= nil then put('r:tat', h['pause'] + c.tau - c.t) end
    put('r:pace', h['pause'])
  end
  settle(numbers(OWN + #dims * STATED + 1, #dims))
  redis.call('PEXPIRE', key, ttl_ms)
  return {0, h['epoch'] or 0, 'learnt'}
end

if op == 'settle' then
  settle(numbers(OWN, #dims))
  return {0, epoch, 'settled'}
end
return redis.error_reply('unknown limiter op ' .. tostring(op))
"""

Reason = Literal["go", "pause", "probe", "pace"]


@dataclass(frozen=True)
class Grant:
    """The limiter's answer: go now (`wait_ms` 0), or wait first and come back with
    `epoch` (a `pace` wait has reserved its slot; `pause` and `probe` have not). A
    `probe` with no wait is the call that goes first, before any limit is known."""

    wait_ms: int
    epoch: int
    reason: Reason


class RateLimits:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def acquire(self, scope: str, cost: Cost, *, held_epoch: int | None = None) -> Grant:
        costs: list[str | int | float] = [cost.of(d) for d in DIMENSIONS]
        held = "" if held_epoch is None else str(held_epoch)
        args: list[str | int | float] = ["acquire", IDLE_TTL_MS, *costs, held, PROBE_MS]
        wait_ms, epoch, reason = self._run(scope, [*args, PROBE_POLL_MS, 1 + PACE_MARGIN])
        return Grant(int(wait_ms), int(epoch), cast(Reason, _text(reason)))

    def learn(
        self,
        scope: str,
        allowances: Mapping[Dimension, Allowance],
        *,
        pause_ms: float | None,
        correction: Cost | None = None,
    ) -> None:
        """What a response said; with `correction`, its call settled in the same trip."""
        args: list[str | int | float] = ["learn", IDLE_TTL_MS]
        for dimension in DIMENSIONS:
            stated = allowances.get(dimension)
            if stated is None:
                args += ["", "", ""]
            else:
                reset = "" if stated.reset_in_ms is None else f"{stated.reset_in_ms:.3f}"
                args += [stated.limit, stated.remaining, reset]
        args.append("" if pause_ms is None else f"{max(pause_ms, 0.0):.3f}")
        args += [correction.of(d) for d in DIMENSIONS] if correction else ["", "", ""]
        self._run(scope, args)

    def settle(self, scope: str, correction: Cost) -> None:
        """Move each bucket by `correction` units (negative: give them back)."""
        moves: list[str | int | float] = [correction.of(d) for d in DIMENSIONS]
        self._run(scope, ["settle", IDLE_TTL_MS, *moves])

    def snapshot(self, scope: str) -> dict[str, float]:
        """The scope's stored cells, for operators and tests (`r:cap`, `pause`, ...)."""
        raw = self.redis.hgetall(self.keys.ratelimit(scope))
        return {_text(k): float(v) for k, v in raw.items()}

    def _run(self, scope: str, args: list[str | int | float]) -> list[int | str | bytes]:
        result = script(self.redis, _LIMITER_LUA)(keys=[self.keys.ratelimit(scope)], args=args)
        return cast(list[int | str | bytes], result)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
