"""The Lua scripts of parked calls (`approvals`): each names its keys and arguments in
its first lines, in the order `approvals.Approvals` passes them, and says above what
it does and returns. Every script that judges a time reads Redis's clock (`TIME`):
machines and clients call them, and their clocks are not trusted (`approvals`).
"""

from __future__ import annotations

from cmdop_worker.state.events import EMIT_FUNCTION

# Redis's clock in ms, for every script that judges a time.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Parks a call: refused when it has an outcome ('answered'), was parked before
# ('again') or the run has a cancel request ('cancelled'); else 'parked'.
PARK_LUA = (
    EMIT_FUNCTION
    + _NOW
    + """
local record_key, index_key, results_key, cancel_key, deadlines_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local event_keys = {KEYS[6], KEYS[7], KEYS[8], KEYS[9]}
local tool_use_id, park, wait_ms, timeout_ms, grace_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local run_deadline_ms, turn, ttl_s = ARGV[6], ARGV[7], ARGV[8]
local approval_member, turn_member = ARGV[9], ARGV[10]
local event_maxlen, event_head, event_tail, index_member = ARGV[11], ARGV[12], ARGV[13], ARGV[14]
if redis.call('HEXISTS', results_key, tool_use_id) == 1 then return 'answered' end
if redis.call('EXISTS', record_key) == 1 then return 'again' end
if redis.call('EXISTS', cancel_key) == 1 then return 'cancelled' end
local expires = math.min(now + tonumber(wait_ms), tonumber(run_deadline_ms))
local asked, expiry = string.format('%.0f', now), string.format('%.0f', expires)
redis.call('HSET', record_key, 'park', park, 'asked_ms', asked, 'expires_ms', expiry,
  'timeout_ms', timeout_ms, 'grace_ms', grace_ms, 'run_deadline_ms', run_deadline_ms,
  'turn', turn)
redis.call('EXPIRE', record_key, ttl_s)
redis.call('SADD', index_key, index_member)
redis.call('EXPIRE', index_key, ttl_s)
redis.call('ZADD', deadlines_key, expiry, approval_member)
local turn_due = string.format('%.0f', expires + tonumber(grace_ms))
redis.call('ZADD', deadlines_key, 'GT', turn_due, turn_member)
emit(event_keys, event_head, event_tail, '0', event_maxlen)
return 'parked'
"""
)

# The keys of answer, close, take and resend, in this order; then the run's four event
# keys (answer and close).
_VERDICT_KEYS = """
local record_key, results_key, deadlines_key, verdict_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local event_keys = {KEYS[5], KEYS[6], KEYS[7], KEYS[8]}
"""

# The verdict's state: none yet is "waiting".
_STATE = """
local state = redis.call('HGET', verdict_key, 'state') or 'waiting'
"""

# A person's answer, once, while the call waits, on the record as shown (`shown`, its
# fingerprint; '' = not checked). Returns the status and the call's deadline when
# approved.
ANSWER_LUA = (
    EMIT_FUNCTION
    + _NOW
    + _VERDICT_KEYS
    + _STATE
    + """
local tool_use_id, verdict, answer = ARGV[1], ARGV[2], ARGV[3]
local approval_member, turn_member = ARGV[4], ARGV[5]
local event_maxlen, event_head, event_tail = ARGV[6], ARGV[7], ARGV[8]
local ttl_s, shown = ARGV[9], ARGV[10]
local park = redis.call('HGET', record_key, 'park')
if not park then return {'no_request', ''} end
if state == 'approved' or state == 'denied' then return {'answered', ''} end
if state ~= 'waiting' then return {state, ''} end
if shown ~= '' and redis.sha1hex(park) ~= shown then return {'changed', ''} end
local f = redis.call('HMGET', record_key, 'park', 'expires_ms', 'timeout_ms', 'run_deadline_ms',
  'grace_ms')
local expires_ms, timeout_ms, run_deadline_ms, grace_ms = f[2], f[3], f[4], f[5]
if redis.call('HEXISTS', results_key, tool_use_id) == 1 then return {'ended', ''} end
if now >= tonumber(expires_ms) then return {'expired', ''} end
local deadline = ''
if verdict == 'approved' then
  local ms = math.min(now + tonumber(timeout_ms), tonumber(run_deadline_ms))
  deadline = string.format('%.0f', ms)
  local turn_due = string.format('%.0f', ms + tonumber(grace_ms))
  redis.call('ZADD', deadlines_key, 'GT', turn_due, turn_member)
end
redis.call('HSET', verdict_key, 'state', verdict, 'answer', answer, 'deadline_ms', deadline,
  'answered_at_ms', string.format('%.0f', now), 'park', park, 'grace_ms', grace_ms)
redis.call('EXPIRE', verdict_key, ttl_s)
redis.call('ZADD', deadlines_key, string.format('%.0f', now + tonumber(grace_ms)), approval_member)
emit(event_keys, event_head, event_tail, '0', event_maxlen)
return {'ok', deadline}
"""
)

# Closes a waiting call as `verdict` ('expired' or 'cancelled'); an expiry not due yet
# is put back to its time. Returns 1 when the caller is to record the call's outcome.
CLOSE_LUA = (
    EMIT_FUNCTION
    + _NOW
    + _VERDICT_KEYS
    + _STATE
    + """
local tool_use_id, verdict, answer, approval_member = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local event_maxlen, event_head, event_tail, ttl_s = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local f = redis.call('HMGET', record_key, 'park', 'expires_ms', 'grace_ms')
local park, expires_ms, grace_ms = f[1], f[2], f[3]
if not park or state ~= 'waiting' then return 0 end
if verdict == 'expired' and now < tonumber(expires_ms) then
  redis.call('ZADD', deadlines_key, expires_ms, approval_member)
  return 0
end
redis.call('HSET', verdict_key, 'state', verdict, 'answer', answer, 'park', park,
  'grace_ms', grace_ms)
redis.call('EXPIRE', verdict_key, ttl_s)
redis.call('ZREM', deadlines_key, approval_member)
if redis.call('HEXISTS', results_key, tool_use_id) == 1 then return 0 end
emit(event_keys, event_head, event_tail, '0', event_maxlen)
return 1
"""
)

# Takes the task carrying `verdict` and `answer`, once, and only when the verdict holds
# that very answer. Returns the status and, when it was taken before, by whom.
TAKE_LUA = (
    _VERDICT_KEYS
    + """
local tool_use_id, verdict, answer, taker, approval_member =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local v = redis.call('HMGET', verdict_key, 'state', 'answer')
local f = redis.call('HMGET', record_key, 'park', 'taken')
local park, taken_by = f[1], f[2]
if not park then return {'unknown', ''} end
if v[1] ~= verdict or v[2] ~= answer then return {'forged', ''} end
local closed = verdict == 'expired' or verdict == 'cancelled'
local ended = redis.call('HEXISTS', results_key, tool_use_id) == 1
if taken_by then
  if closed or ended then return {'ended', taken_by} end
  return {'again', taken_by}
end
redis.call('HSET', record_key, 'taken', taker)
redis.call('ZREM', deadlines_key, approval_member)
if not closed and ended then return {'ended', ''} end
return {'ok', ''}
"""
)

# 1 when the answer's task is to be sent again (answered, not taken, no outcome): the
# entry is put off by the time since the answer (at least a grace), so a busy
# machine's queue gets few.
RESEND_LUA = (
    _NOW
    + _VERDICT_KEYS
    + """
local tool_use_id, approval_member = ARGV[1], ARGV[2]
local f = redis.call('HMGET', verdict_key, 'state', 'answered_at_ms', 'grace_ms')
local state, answered_at_ms, grace_ms = f[1], f[2], f[3]
local taken = redis.call('HGET', record_key, 'taken')
if (state ~= 'approved' and state ~= 'denied') or taken then return 0 end
if redis.call('HEXISTS', results_key, tool_use_id) == 1 then return 0 end
local gap = math.max(tonumber(grace_ms), now - tonumber(answered_at_ms or now))
redis.call('ZADD', deadlines_key, string.format('%.0f', now + gap), approval_member)
return 1
"""
)
