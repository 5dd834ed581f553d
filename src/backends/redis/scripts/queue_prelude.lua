-- Shared head of every queue script (prepended at build time; Redis scripts cannot include).
-- One queue per name, every key under the name's hash tag:
--   KEYS[1] fencing counter (INCR; never deleted, so tokens keep growing)
--   KEYS[2] queue     zset  seq -> seq (arrival order)
--   KEYS[3] entries   hash  seq -> "<kind><admitted> <permits> <limit> <request> <pid> <host> <since ms>"
--                           kind x|s|l, admitted 0|1; limit is the Semaphore's (0 for locks)
--   KEYS[4] expiries  zset  seq -> lease end in ms (server clock)
--   KEYS[5] requests  hash  request id -> seq (a retried acquire finds its entry)
-- ARGV[1] is always the wake-up channel. Scripts make as few calls as they can: each one
-- costs server time on every lock and unlock.
local counter_key, queue_key, entries_key, expiry_key, requests_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- kind, admitted ('0'|'1'), permits, limit, request of an entry's text
local function parse(entry)
  local kind, admitted, permits, limit, request = string.match(entry, '^(%a)(%d) (%d+) (%d+) (%S+)')
  return kind, admitted, tonumber(permits), tonumber(limit), request
end

local function remove_entry(seq, entry)
  local _, _, _, _, request = parse(entry)
  redis.call('HDEL', requests_key, request)
  redis.call('ZREM', queue_key, seq)
  redis.call('HDEL', entries_key, seq)
  redis.call('ZREM', expiry_key, seq)
end

-- Entries whose holder stopped renewing (it died, or paused past its lease) leave the queue.
local function reap_expired(now)
  local expired = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now)
  for _, seq in ipairs(expired) do
    local entry = redis.call('HGET', entries_key, seq)
    if entry then remove_entry(seq, entry) else redis.call('ZREM', expiry_key, seq) end
  end
  return #expired
end

-- The one queue predicate: walks the queue in order, marks every entry it now admits, and
-- publishes the newly admitted sequence numbers, so exactly those waiters wake. `quiet` is
-- the caller's own entry, which needs no message.
local function admit(quiet)
  local used, position, woken, limit = 0, 0, {}, nil
  -- false ends the walk: nobody behind a waiter (or behind a writer) is admitted
  local function visit(seq)
    local entry = redis.call('HGET', entries_key, seq)
    local kind, admitted, permits, entry_limit = parse(entry)
    local fits
    if kind == 'l' then
      limit = limit or entry_limit
      used = used + permits
      fits = used <= limit
    else
      fits = kind == 's' or position == 0
    end
    if not fits then return false end
    if admitted == '0' then
      redis.call('HSET', entries_key, seq, kind .. '1' .. string.sub(entry, 3))
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
