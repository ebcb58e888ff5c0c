"""The Lua scripts of parked calls (`approvals`): each names its keys and arguments in
the comment above it. Every script that judges a time reads Redis's clock (`TIME`).
"""

from __future__ import annotations

from cmdop_worker.state.events import EMIT_FUNCTION

# Redis's clock in ms, for every script that judges a time.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: record, index, results, cancel, deadlines, the run's four event keys.
# ARGV: tuid, park JSON, wait, timeout, grace, run deadline, turn, ttl, approval
# member, turn member, maxlen, APPROVAL_REQUEST's head and tail, index member.
PARK_LUA = (
    EMIT_FUNCTION
    + _NOW
    + """
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 'answered' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'again' end
if redis.call('EXISTS', KEYS[4]) == 1 then return 'cancelled' end
local expires = math.min(now + tonumber(ARGV[3]), tonumber(ARGV[6]))
local asked, expiry = string.format('%.0f', now), string.format('%.0f', expires)
redis.call('HSET', KEYS[1], 'park', ARGV[2], 'asked_ms', asked, 'expires_ms', expiry,
  'timeout_ms', ARGV[4], 'grace_ms', ARGV[5], 'run_deadline_ms', ARGV[6], 'turn', ARGV[7])
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('SADD', KEYS[2], ARGV[14])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[5], expiry, ARGV[9])
redis.call('ZADD', KEYS[5], 'GT', string.format('%.0f', expires + tonumber(ARGV[5])), ARGV[10])
emit({KEYS[6], KEYS[7], KEYS[8], KEYS[9]}, ARGV[12], ARGV[13], '0', ARGV[11])
return 'parked'
"""
)

# The verdict's state: none yet is "waiting".
_STATE = """
local state = redis.call('HGET', KEYS[4], 'state') or 'waiting'
"""

# KEYS: record, results, deadlines, verdict, the run's four event keys. ARGV: tuid,
# verdict, answer JSON, approval member, turn member, maxlen, APPROVAL_RESOLVED's head,
# tail, ttl, the fingerprint of the record as shown ('' = not checked).
ANSWER_LUA = (
    EMIT_FUNCTION
    + _NOW
    + _STATE
    + """
local park = redis.call('HGET', KEYS[1], 'park')
if not park then return {'no_request', ''} end
if state == 'approved' or state == 'denied' then return {'answered', ''} end
if state ~= 'waiting' then return {state, ''} end
if ARGV[10] ~= '' and redis.sha1hex(park) ~= ARGV[10] then return {'changed', ''} end
local f = redis.call('HMGET', KEYS[1], 'park', 'expires_ms', 'timeout_ms', 'run_deadline_ms',
  'grace_ms')
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'ended', ''} end
if now >= tonumber(f[2]) then return {'expired', ''} end
local deadline = ''
if ARGV[2] == 'approved' then
  local ms = math.min(now + tonumber(f[3]), tonumber(f[4]))
  deadline = string.format('%.0f', ms)
  redis.call('ZADD', KEYS[3], 'GT', string.format('%.0f', ms + tonumber(f[5])), ARGV[5])
end
redis.call('HSET', KEYS[4], 'state', ARGV[2], 'answer', ARGV[3], 'deadline_ms', deadline,
  'answered_at_ms', string.format('%.0f', now), 'park', park, 'grace_ms', f[5])
redis.call('EXPIRE', KEYS[4], ARGV[9])
redis.call('ZADD', KEYS[3], string.format('%.0f', now + tonumber(f[5])), ARGV[4])
emit({KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, ARGV[7], ARGV[8], '0', ARGV[6])
return {'ok', deadline}
"""
)

# KEYS: record, results, deadlines, verdict, the run's four event keys. ARGV: tuid,
# verdict, answer JSON, approval member, maxlen, APPROVAL_RESOLVED's head and tail,
# ttl. Returns 1 when the caller is to record the call's outcome.
CLOSE_LUA = (
    EMIT_FUNCTION
    + _NOW
    + _STATE
    + """
local f = redis.call('HMGET', KEYS[1], 'park', 'expires_ms', 'grace_ms')
if not f[1] or state ~= 'waiting' then return 0 end
if ARGV[2] == 'expired' and now < tonumber(f[2]) then
  redis.call('ZADD', KEYS[3], f[2], ARGV[4])
  return 0
end
redis.call('HSET', KEYS[4], 'state', ARGV[2], 'answer', ARGV[3], 'park', f[1], 'grace_ms', f[3])
redis.call('EXPIRE', KEYS[4], ARGV[8])
redis.call('ZREM', KEYS[3], ARGV[4])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
emit({KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, ARGV[6], ARGV[7], '0', ARGV[5])
return 1
"""
)

# KEYS: record, results, deadlines, verdict. ARGV: tuid, verdict, answer JSON, taker,
# approval member. Returns the status and, when it was taken before, by whom.
TAKE_LUA = """
local v = redis.call('HMGET', KEYS[4], 'state', 'answer')
local f = redis.call('HMGET', KEYS[1], 'park', 'taken')
if not f[1] then return {'unknown', ''} end
if v[1] ~= ARGV[2] or v[2] ~= ARGV[3] then return {'forged', ''} end
local closed = ARGV[2] == 'expired' or ARGV[2] == 'cancelled'
local ended = redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
if f[2] then
  if closed or ended then return {'ended', f[2]} end
  return {'again', f[2]}
end
redis.call('HSET', KEYS[1], 'taken', ARGV[4])
redis.call('ZREM', KEYS[3], ARGV[5])
if not closed and ended then return {'ended', ''} end
return {'ok', ''}
"""

# KEYS: record, results, deadlines, verdict. ARGV: tuid, approval member. 1 when the answer's
# task is to be sent again (answered, not taken, no outcome): the entry is put off by
# the time since the answer (at least a grace), so a busy machine's queue gets few.
RESEND_LUA = (
    _NOW
    + """
local f = redis.call('HMGET', KEYS[4], 'state', 'answered_at_ms', 'grace_ms')
local taken = redis.call('HGET', KEYS[1], 'taken')
if (f[1] ~= 'approved' and f[1] ~= 'denied') or taken then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local gap = math.max(tonumber(f[3]), now - tonumber(f[2] or now))
redis.call('ZADD', KEYS[3], string.format('%.0f', now + gap), ARGV[2])
return 1
"""
)
