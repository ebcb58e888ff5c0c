"""The thread store's Lua scripts (`threads`): claim, release and drop, each with the
comment above it saying what it does and returns. Each names its keys and arguments in
its first lines; `threads.ThreadStore` passes them in that order (`scripts.run_script`).
"""

from __future__ import annotations

from cmdop_worker.state.fence import FENCE_FUNCTION

# A run that claimed its thread stores its state a moment later; a claim whose run has
# neither state nor ending after this long (its starter died) no longer holds the thread.
STARTING_GRACE_MS = 60_000

# Takes the thread for a run, or does with its request what `on_busy` says. Returns
# {outcome, detail, kick}: detail is the history JSON (started), the active run id
# (steered, busy, interrupts, queued); kick is the queue head to start again ('' for
# none). A run that already exists (a redelivered `cmdop.run`) changes nothing:
# 'exists'. A run's own keys are spelled from `key_prefix` as `state.keys` spells them.
CLAIM_LUA = """
local active_key, queue_key, runs_key, history_key, index_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id, on_busy, request, steer_text = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl_s, now_ms, key_prefix, thread_id = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local function run_key(id, part) return key_prefix .. 'run:' .. id .. ':' .. part end
if redis.call('EXISTS', run_key(run_id, 'state')) == 1 then
  return {'exists', '', ''}
end
local function running(entry)
  if not entry then return false end
  local id, since = string.match(entry, '^(%S+) (%d+)$')
  if not id then return false end
  if redis.call('EXISTS', run_key(id, 'terminal')) == 1 then return false end
  if redis.call('EXISTS', run_key(id, 'state')) == 1 then return id end
  if tonumber(now_ms) - tonumber(since) < STARTING_GRACE then return id end
  return false
end
local function touch()
  for _, key in ipairs({active_key, queue_key, runs_key, history_key}) do
    redis.call('EXPIRE', key, ttl_s)
  end
  redis.call('ZADD', index_key, now_ms, thread_id)
end
local active = running(redis.call('GET', active_key))
if active == run_id then touch() return {'started', redis.call('GET', history_key) or '[]', ''} end
local head = redis.call('LINDEX', queue_key, 0)
local head_id = head and cjson.decode(head)['run_id'] or nil
if not active and (not head or head_id == run_id) then
  if head then redis.call('LPOP', queue_key) end
  redis.call('SET', active_key, run_id .. ' ' .. now_ms)
  redis.call('RPUSH', runs_key, run_id)
  touch()
  return {'started', redis.call('GET', history_key) or '[]', ''}
end
local kick = (not active and head) or ''
local busy_with = active or head_id
if on_busy == 'steer' and active and steer_text ~= '' then
  local steer_key = run_key(active, 'steer')
  for _, entry in ipairs(redis.call('LRANGE', steer_key, 0, -1)) do
    if cjson.decode(entry)['id'] == run_id then return {'steered', active, kick} end
  end
  redis.call('RPUSH', steer_key, cjson.encode({id = run_id, text = steer_text}))
  redis.call('EXPIRE', steer_key, ttl_s)
  touch()
  return {'steered', active, kick}
end
for _, waiting in ipairs(redis.call('LRANGE', queue_key, 0, -1)) do
  if cjson.decode(waiting)['run_id'] == run_id then
    return {on_busy == 'interrupt' and 'interrupts' or 'queued', busy_with, kick}
  end
end
if on_busy == 'interrupt' then
  redis.call('LPUSH', queue_key, request)
  touch()
  return {'interrupts', busy_with, kick}
end
if on_busy == 'enqueue' or on_busy == 'steer' then
  redis.call('RPUSH', queue_key, request)
  touch()
  return {'queued', busy_with, kick}
end
return {'busy', busy_with, kick}
""".replace("STARTING_GRACE", str(STARTING_GRACE_MS))

# Frees the thread, if the run still holds it and its executor its turn (the turn's
# lock holds `token`; '' = unfenced), storing the run's history and putting a
# follow-up request first in the queue ('' = none). Returns the queue's head ('' for
# none) to be started next, or -1 when fenced out.
RELEASE_LUA = (
    FENCE_FUNCTION
    + """
local active_key, queue_key, runs_key, history_key, index_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lock_key, attempts_key = KEYS[6], KEYS[7]
local run_id, history, ttl_s, now_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local thread_id, token, attempt, lease_ms = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local follow_up = ARGV[9]
if not fenced(lock_key, attempts_key, token, attempt, lease_ms) then return -1 end
local entry = redis.call('GET', active_key)
if entry and string.match(entry, '^(%S+) ') == run_id then
  redis.call('SET', history_key, history, 'EX', ttl_s)
  redis.call('DEL', active_key)
  if follow_up ~= '' then redis.call('LPUSH', queue_key, follow_up) end
  redis.call('EXPIRE', queue_key, ttl_s)
  redis.call('EXPIRE', runs_key, ttl_s)
  redis.call('ZADD', index_key, now_ms, thread_id)
end
return redis.call('LINDEX', queue_key, 0) or ''
"""
)

# Drops a waiting request that can never start; returns the new head ('' for none).
DROP_LUA = """
local queue_key = KEYS[1]
local run_id = ARGV[1]
for _, waiting in ipairs(redis.call('LRANGE', queue_key, 0, -1)) do
  if cjson.decode(waiting)['run_id'] == run_id then redis.call('LREM', queue_key, 1, waiting) end
end
return redis.call('LINDEX', queue_key, 0) or ''
"""
