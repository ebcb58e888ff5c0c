"""The per-turn barrier's Lua scripts (`barrier`): record an outcome, open a turn, start
a call. Each says above what it does and returns, and names its keys and arguments in
its first lines, in the order `barrier.Barrier` passes them (`scripts.run_script`).
"""

from __future__ import annotations

from cmdop_worker.state.events import EMIT_FUNCTION
from cmdop_worker.state.fence import FENCE_FUNCTION

# The barrier's one rule, shared by both scripts that can complete a turn: once the
# turn's results reach the expected count, the first writer to win the `advanced` key
# advances it, scheduling the watchdog's `advance:` entry for the next turn. Returns 1
# to that writer, else 0. `expected` < 0: the count is not declared yet.
_ADVANCE_FUNCTION = """
local function advance_if_complete(results, advanced, deadlines, expected, ttl, member, due)
  if expected >= 0 and redis.call('HLEN', results) >= expected then
    if redis.call('SET', advanced, '1', 'NX', 'EX', ttl) then
      redis.call('ZADD', deadlines, due, member)
      return 1
    end
  end
  return 0
end
"""

# The turn's deadline entry pushed past a call handed out now (`QueuedCall.handed_out`).
_COVER_FUNCTION = """
local function cover(deadlines, member, queued, now)
  local ok, q = pcall(cjson.decode, queued)
  if not ok or type(q) ~= 'table' then return end
  local timeout, cap = tonumber(q.timeout_ms) or 0, tonumber(q.run_deadline_ms) or 0
  if timeout <= 0 or cap <= 0 then return end
  local due = math.min(now + timeout, cap) + (tonumber(q.grace_ms) or 0)
  redis.call('ZADD', deadlines, 'GT', string.format('%.0f', due), member)
end
"""

# Stores an outcome once, writing its events with it (the first, a TOOL_START, only if
# the call was never marked started), hands out a sequential turn's next call when
# this one was out, or a fan-out's next batch when this copy was the last of its batch
# out (`batch_out`, a set; `batch_queue`, the batches to come as JSON lists of ids; a
# copy answered while it waited is skipped), and advances the turn when it completes.
# Returns the advance code (-1: a duplicate), the call handed out (or false), the run's
# cancel request (or false): a call handed out under a cancel is answered, never sent,
# and the batch handed out (the QueuedCall of each of its copies, or false).
RECORD_LUA = (
    EMIT_FUNCTION
    + _ADVANCE_FUNCTION
    + _COVER_FUNCTION
    + """
local results_key, expected_key, advanced_key, deadlines_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local current_key, queue_key, calls_key = KEYS[5], KEYS[6], KEYS[7]
local started_key, cancel_key = KEYS[8], KEYS[9]
local batch_out_key, batch_queue_key = KEYS[10], KEYS[11]
local event_keys = {KEYS[12], KEYS[13], KEYS[14], KEYS[15]}
local tool_use_id, outcome, ttl_s = ARGV[1], ARGV[2], ARGV[3]
local next_turn_member, next_turn_due_ms = ARGV[4], ARGV[5]
local event_maxlen, first_is_start = ARGV[6], ARGV[7] == '1'
local resend_member, resend_due_ms = ARGV[8], ARGV[9]
local now_ms, turn_member = tonumber(ARGV[10]), ARGV[11]
local FIRST_EVENT = 12  -- then the head and tail of each event
if redis.call('HSETNX', results_key, tool_use_id, outcome) == 0 then
  return {-1, false, false, false}
end
redis.call('EXPIRE', results_key, ttl_s)
for i = FIRST_EVENT, #ARGV, 2 do
  local start_marked = i == FIRST_EVENT and first_is_start
    and redis.call('EXISTS', started_key) == 1
  if not start_marked then emit(event_keys, ARGV[i], ARGV[i + 1], '0', event_maxlen) end
end
local handed, cancel = false, false
if redis.call('GET', current_key) == tool_use_id then
  while true do
    local id = redis.call('LPOP', queue_key)
    if not id then redis.call('DEL', current_key) break end
    if redis.call('HEXISTS', results_key, id) == 0 then
      redis.call('SET', current_key, id, 'EX', ttl_s)
      redis.call('ZADD', deadlines_key, resend_due_ms, resend_member)
      handed = redis.call('HGET', calls_key, id)
      cancel = redis.call('GET', cancel_key)
      if handed and not cancel then cover(deadlines_key, turn_member, handed, now_ms) end
      break
    end
  end
end
local batch = false
local ended_batch = redis.call('SREM', batch_out_key, tool_use_id) == 1
if ended_batch and redis.call('SCARD', batch_out_key) == 0 then
  while not batch do
    local ids = redis.call('LPOP', batch_queue_key)
    if not ids then break end
    for _, id in ipairs(cjson.decode(ids)) do
      if redis.call('HEXISTS', results_key, id) == 0 then redis.call('SADD', batch_out_key, id) end
    end
    local out = redis.call('SMEMBERS', batch_out_key)
    if #out > 0 then
      redis.call('EXPIRE', batch_out_key, ttl_s)
      redis.call('ZADD', deadlines_key, resend_due_ms, resend_member)
      batch = redis.call('HMGET', calls_key, unpack(out))
      cancel = redis.call('GET', cancel_key)
      if not cancel then
        for _, queued in ipairs(batch) do
          if queued then cover(deadlines_key, turn_member, queued, now_ms) end
        end
      end
    end
  end
end
local expected = tonumber(redis.call('GET', expected_key) or '-1')
local code = advance_if_complete(
  results_key, advanced_key, deadlines_key, expected, ttl_s, next_turn_member, next_turn_due_ms)
return {code, handed, cancel, batch}
"""
)

# Opens a turn: saves the run's state (fenced; '' = no save), stores a sequential
# turn's calls in order (the first is the one out; '' = not sequential), schedules
# watchdog entries (an entry already later stays) and declares the expected count, in
# one step. Returns 1 when already complete, 0, or -1 fenced out (nothing written).
OPEN_TURN_LUA = (
    FENCE_FUNCTION
    + _ADVANCE_FUNCTION
    + """
local results_key, expected_key, advanced_key, deadlines_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local state_key, lock_key, attempts_key = KEYS[5], KEYS[6], KEYS[7]
local current_key, queue_key, calls_key = KEYS[8], KEYS[9], KEYS[10]
local expected, ttl_s = ARGV[1], ARGV[2]
local next_turn_member, next_turn_due_ms = ARGV[3], ARGV[4]
local state, token, attempt, lease_ms = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local first_call, call_count = ARGV[9], tonumber(ARGV[10])
local FIRST_CALL = 11  -- call_count (id, QueuedCall JSON) pairs, then (member, due) pairs
local FIRST_ENTRY = FIRST_CALL + 2 * call_count
if state ~= '' then
  if not fenced(lock_key, attempts_key, token, attempt, lease_ms) then return -1 end
  redis.call('SET', state_key, state)
end
if first_call ~= '' then
  redis.call('DEL', queue_key, calls_key)
  redis.call('SET', current_key, first_call, 'EX', ttl_s)
  for i = FIRST_CALL, FIRST_ENTRY - 1, 2 do
    redis.call('HSET', calls_key, ARGV[i], ARGV[i + 1])
    if ARGV[i] ~= first_call then redis.call('RPUSH', queue_key, ARGV[i]) end
  end
  redis.call('EXPIRE', queue_key, ttl_s)
  redis.call('EXPIRE', calls_key, ttl_s)
end
for i = FIRST_ENTRY, #ARGV, 2 do redis.call('ZADD', deadlines_key, 'GT', ARGV[i + 1], ARGV[i]) end
redis.call('SET', expected_key, expected, 'EX', ttl_s)
return advance_if_complete(results_key, advanced_key, deadlines_key, tonumber(expected), ttl_s,
  next_turn_member, next_turn_due_ms)
"""
)

# Marks a call started by `holder` and writes its TOOL_START, in one step with the
# checks that may keep it from starting, in this order: a message its sender's record
# (`sent.call_digest`) does not match, or that has none, was not sent by the control
# plane ('unsent': nothing read or written; an empty digest is a call the coordinator
# runs itself, which no message started); the call has an outcome ('answered'); a
# cancel to honour at once, a ui one or any past the run's deadline ('cancelled', with
# the request); the call's own deadline passed before it ever started ('late'). Else
# 'first', or 'again' with who started it before.
START_CALL_LUA = (
    EMIT_FUNCTION
    + """
local results_key, started_key, cancel_key = KEYS[1], KEYS[2], KEYS[3]
local event_keys = {KEYS[4], KEYS[5], KEYS[6], KEYS[7]}
local sent_key = KEYS[8]
local tool_use_id, holder, ttl_s = ARGV[1], ARGV[2], ARGV[3]
local run_deadline_passed, event_maxlen = ARGV[4] == '1', ARGV[5]
local event_head, event_tail = ARGV[6], ARGV[7]
local call_deadline_passed, digest = ARGV[8] == '1', ARGV[9]
if digest ~= '' and redis.call('GET', sent_key) ~= digest then return {'unsent', ''} end
if redis.call('HEXISTS', results_key, tool_use_id) == 1 then return {'answered', ''} end
local cancel = redis.call('GET', cancel_key)
if cancel then
  local ok, request = pcall(cjson.decode, cancel)
  if run_deadline_passed or (ok and type(request) == 'table' and request.channel == 'ui') then
    return {'cancelled', cancel}
  end
end
if call_deadline_passed and redis.call('EXISTS', started_key) == 0 then return {'late', ''} end
if redis.call('SET', started_key, holder, 'NX', 'EX', ttl_s) then
  emit(event_keys, event_head, event_tail, '0', event_maxlen)
  return {'first', ''}
end
return {'again', redis.call('GET', started_key) or ''}
"""
)
