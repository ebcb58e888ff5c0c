"""Presence's Lua scripts (`presence`): a machine announcing itself, a machine leaving,
a machine putting its name back in the index, and a reader forgetting machines whose
key is gone. Each moves the fleet's version on
(`_BUMP`) and names its keys and arguments in its first lines, in the order
`presence` passes them (`scripts.run_script`). Each also stamps the machine's
last-seen time in `machines:seen`, the names the fleet remembers: when it announced
itself, when it left, or (forgotten) when its presence lapsed, never later than now.
And each logs the machine it changed in `machines:changed` (`_LOG`), so a reader that
holds the fleet at one version reads only the machines changed since.
"""

from __future__ import annotations

# How long the change log keeps a change (in the version's unit, microseconds of Redis
# time): a reader that last read longer ago than this reads the whole fleet again.
CHANGES_KEPT_US = 600_000_000

# The version moves to max(version + 1, Redis time in microseconds): it never comes back
# to a value a reader may hold, even after Redis lost it (a flush, a restore). It returns
# the version before (nil when there was none, or it was no whole number a double holds
# exactly: readers never trust such a one, `presence._version`) and the new one.
_BUMP = """
local function bump(version_key)
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local before = tonumber(redis.call('GET', version_key))
  if before and not (before >= 0 and before < 2^53) then
    before = nil  -- not a version (a machine's credentials may write anything there)
  end
  local next = math.max((before or 0) + 1, floor)
  redis.call('SET', version_key, string.format('%.0f', next))
  return before, next
end
"""

# The change log: each machine a change touched, scored with the version that change
# moved the fleet to (a name changed again keeps only its latest). `since_key` holds the
# version after which the log is complete: a reader holding a version at or after it
# reads the names scored above its version and misses nothing. A log Redis lost (or a
# fleet's first) starts complete from the version before this change. Changes older than
# CHANGES_KEPT_US are trimmed, never those after `before` (a reader that is current stays
# so however long the fleet was quiet), and `since_key` moves up to what was trimmed.
_LOG = (
    """
local function log_changes(changed_key, since_key, before, version, machines)
  local since = tonumber(redis.call('GET', since_key))
  if not since then
    since = before or (version - 1)
    redis.call('SET', since_key, string.format('%.0f', since))
  end
  for _, machine in ipairs(machines) do
    redis.call('ZADD', changed_key, string.format('%.0f', version), machine)
  end
  local cutoff = math.min(version - """
    + str(CHANGES_KEPT_US)
    + """, before or version)
  if cutoff > since and redis.call(
      'ZREMRANGEBYSCORE', changed_key, '-inf', string.format('%.0f', cutoff)) > 0 then
    redis.call('SET', since_key, string.format('%.0f', cutoff))
  end
end
"""
)

ANNOUNCE = (
    """
local presence_key = KEYS[1]
local index_key = KEYS[2]
local alive_key = KEYS[3]
local version_key = KEYS[4]
local seen_key = KEYS[5]
local changed_key = KEYS[6]
local since_key = KEYS[7]
local machine = ARGV[1]
local payload = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
"""
    + _BUMP
    + _LOG
    + """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', presence_key, payload, 'PX', ttl_ms)
redis.call('SADD', index_key, machine)
redis.call('ZADD', alive_key, now_ms + ttl_ms, machine)
redis.call('ZADD', seen_key, now_ms, machine)
local before, version = bump(version_key)
log_changes(changed_key, since_key, before, version, {machine})
return now_ms
"""
)

LEAVE = (
    """
local presence_key = KEYS[1]
local index_key = KEYS[2]
local alive_key = KEYS[3]
local version_key = KEYS[4]
local seen_key = KEYS[5]
local changed_key = KEYS[6]
local since_key = KEYS[7]
local machine = ARGV[1]
"""
    + _BUMP
    + _LOG
    + """
local t = redis.call('TIME')
redis.call('ZADD', seen_key, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), machine)
redis.call('DEL', presence_key)
redis.call('SREM', index_key, machine)
redis.call('ZREM', alive_key, machine)
local before, version = bump(version_key)
log_changes(changed_key, since_key, before, version, {machine})
return 1
"""
)

# KEYS after the six named: the presence key of each name in ARGV, in that order. Only a
# name still in the index counts as forgotten (moves the version on, is logged): readers
# that saw a machine leave do not move the version on again.
FORGET = (
    """
local index_key = KEYS[1]
local alive_key = KEYS[2]
local version_key = KEYS[3]
local seen_key = KEYS[4]
local changed_key = KEYS[5]
local since_key = KEYS[6]
local first_presence = 7
"""
    + _BUMP
    + _LOG
    + """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local forgotten = {}
for i, machine in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[first_presence + i - 1]) == 0 then
    local lapsed = tonumber(redis.call('ZSCORE', alive_key, machine))
    if lapsed then
      redis.call('ZADD', seen_key, 'GT', math.min(lapsed, now_ms), machine)
    end
    if redis.call('SREM', index_key, machine) == 1 then
      table.insert(forgotten, machine)
    end
    redis.call('ZREM', alive_key, machine)
  end
end
if #forgotten > 0 then
  local before, version = bump(version_key)
  log_changes(changed_key, since_key, before, version, forgotten)
end
return #forgotten
"""
)

# A renewal found its name missing from the index (removed by someone else: any machine's
# credentials may write the index) and put it back with its SADD: the version moves on
# and the change is logged, so readers read it again; its lapse and last-seen times are
# stamped as an announce stamps them. Nothing when its key is gone (it announces again).
HEALED = (
    """
local presence_key = KEYS[1]
local index_key = KEYS[2]
local alive_key = KEYS[3]
local version_key = KEYS[4]
local seen_key = KEYS[5]
local changed_key = KEYS[6]
local since_key = KEYS[7]
local machine = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
"""
    + _BUMP
    + _LOG
    + """
if redis.call('EXISTS', presence_key) == 0 then
  return 0
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SADD', index_key, machine)
redis.call('ZADD', alive_key, now_ms + ttl_ms, machine)
redis.call('ZADD', seen_key, now_ms, machine)
local before, version = bump(version_key)
log_changes(changed_key, since_key, before, version, {machine})
return 1
"""
)
