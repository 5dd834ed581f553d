-- Shared head of every queue script (prepended at build time; Redis scripts cannot include).
-- One queue per name, every key under the name's hash tag:
--   KEYS[1] fencing counter (INCR; never deleted, so tokens keep growing)
--   KEYS[2] queue     zset  seq -> seq (arrival order)
--   KEYS[3] entries   hash  seq -> "<kind><admitted> <permits>", kind x|s|l, admitted 0|1
--   KEYS[4] expiries  zset  seq -> lease end in ms (server clock)
--   KEYS[5] mode      hash  kind = lock|semaphore, limit = N (while the queue has entries)
--   KEYS[6] info      hash  seq -> "<request id> <pid> <since ms> <host>" (for inspect)
--   KEYS[7] requests  hash  request id -> seq (makes a retried acquire find its entry)
-- ARGV[1] is always the wake-up channel.
local counter_key, queue_key, entries_key, expiry_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local mode_key, info_key, requests_key = KEYS[5], KEYS[6], KEYS[7]
local channel = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function remove_entry(seq)
  local info = redis.call('HGET', info_key, seq)
  if info then redis.call('HDEL', requests_key, string.match(info, '^(%S+)')) end
  redis.call('ZREM', queue_key, seq)
  redis.call('HDEL', entries_key, seq)
  redis.call('ZREM', expiry_key, seq)
  redis.call('HDEL', info_key, seq)
end

-- Entries whose holder stopped renewing (it died, or paused past its lease) leave the queue.
local function reap_expired(now)
  local expired = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now)
  for _, seq in ipairs(expired) do remove_entry(seq) end
  return #expired
end

-- The one queue predicate: walks the queue in order, marks every entry it now admits, and
-- publishes the newly admitted sequence numbers, so exactly those waiters wake. `quiet` is
-- the caller's own entry, which needs no message.
local function admit(quiet)
  if redis.call('ZCARD', queue_key) == 0 then
    redis.call('DEL', mode_key)
    return
  end
  local mode = redis.call('HMGET', mode_key, 'kind', 'limit')
  local semaphore = mode[1] == 'semaphore'
  local limit = tonumber(mode[2]) or 0
  local used, position, woken = 0, 0, {}
  -- false ends the walk: nobody behind a waiter (or behind a writer) is admitted
  local function visit(seq)
    local entry = redis.call('HGET', entries_key, seq)
    local kind, admitted, permits = string.sub(entry, 1, 1), string.sub(entry, 2, 2), tonumber(string.sub(entry, 4))
    local fits
    if semaphore then
      used = used + permits
      fits = used <= limit
    else
      fits = kind == 's' or position == 0
    end
    if not fits then return false end
    if admitted == '0' then
      redis.call('HSET', entries_key, seq, kind .. '1 ' .. permits)
      if seq ~= quiet then woken[#woken + 1] = seq end
    end
    position = position + 1
    return kind ~= 'x'
  end
  local start = 0
  repeat
    local batch = redis.call('ZRANGE', queue_key, start, start + 63)
    local going = #batch == 64
    for _, seq in ipairs(batch) do
      if not visit(seq) then
        going = false
        break
      end
    end
    start = start + 64
  until not going
  if #woken > 0 then redis.call('PUBLISH', channel, table.concat(woken, ' ')) end
end
