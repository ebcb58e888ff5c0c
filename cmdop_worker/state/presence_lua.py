"""Presence's Lua scripts (`presence`): a machine announcing itself, a machine leaving,
and a reader forgetting machines whose key is gone. Each moves the fleet's version on
(`_BUMP`) and names its keys and arguments in its first lines, in the order
`presence` passes them (`scripts.run_script`). Each also stamps the machine's
last-seen time in `machines:seen`, the names the fleet remembers: when it announced
itself, when it left, or (forgotten) when its presence lapsed, never later than now.
"""

from __future__ import annotations

# The version moves to max(version + 1, Redis time in microseconds): it never comes back
# to a value a reader may hold, even after Redis lost it (a flush, a restore).
_BUMP = """
local function bump(version_key)
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local next = math.max((tonumber(redis.call('GET', version_key)) or 0) + 1, floor)
  redis.call('SET', version_key, string.format('%.0f', next))
end
"""

ANNOUNCE = (
    """
local presence_key = KEYS[1]
local index_key = KEYS[2]
local alive_key = KEYS[3]
local version_key = KEYS[4]
local seen_key = KEYS[5]
local machine = ARGV[1]
local payload = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
"""
    + _BUMP
    + """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', presence_key, payload, 'PX', ttl_ms)
redis.call('SADD', index_key, machine)
redis.call('ZADD', alive_key, now_ms + ttl_ms, machine)
redis.call('ZADD', seen_key, now_ms, machine)
bump(version_key)
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
local machine = ARGV[1]
"""
    + _BUMP
    + """
local t = redis.call('TIME')
redis.call('ZADD', seen_key, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), machine)
redis.call('DEL', presence_key)
redis.call('SREM', index_key, machine)
redis.call('ZREM', alive_key, machine)
bump(version_key)
return 1
"""
)

# KEYS after the four named: the presence key of each name in ARGV, in that order.
FORGET = (
    """
local index_key = KEYS[1]
local alive_key = KEYS[2]
local version_key = KEYS[3]
local seen_key = KEYS[4]
local first_presence = 5
"""
    + _BUMP
    + """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local forgotten = 0
for i, machine in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[first_presence + i - 1]) == 0 then
    local lapsed = tonumber(redis.call('ZSCORE', alive_key, machine))
    if lapsed then
      redis.call('ZADD', seen_key, 'GT', math.min(lapsed, now_ms), machine)
    end
    redis.call('SREM', index_key, machine)
    redis.call('ZREM', alive_key, machine)
    forgotten = forgotten + 1
  end
end
if forgotten > 0 then bump(version_key) end
return forgotten
"""
)
