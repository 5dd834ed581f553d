-- Shared head of the PermitCounter scripts (prepended at build time). Redisson's RSemaphore
-- layout, so Java and C++ share the permits: KEYS[1] is the name itself, a plain string
-- holding the count, and releases are published on ARGV[1] = "redisson_sc:{NAME}".
-- turnstile adds a FIFO of waiters beside it, in the same cluster slot:
--   KEYS[2] waiters zset seq -> seq, KEYS[3] expiries zset seq -> lease end ms,
--   KEYS[4] waiter counter, KEYS[5] info hash seq -> "<pid> <host> <since ms>".
-- Redisson's own waiters do not queue there: they may overtake turnstile's.
local permits_key, waiters_key, expiry_key, counter_key, info_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function available()
  return tonumber(redis.call('GET', permits_key) or '0')
end

local function remove_waiter(seq)
  redis.call('ZREM', waiters_key, seq)
  redis.call('ZREM', expiry_key, seq)
  redis.call('HDEL', info_key, seq)
end

-- The waiter now first in line looks again (every waiter listens; only a client's oldest
-- waiter of the name acts on a message).
local function nudge()
  local value = available()
  if value > 0 and redis.call('ZCARD', waiters_key) > 0 then redis.call('PUBLISH', channel, value) end
end

-- Waiters that stopped renewing (dead, or paused past their lease) leave the line.
local function reap_expired(now)
  local expired = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now)
  for _, seq in ipairs(expired) do remove_waiter(seq) end
  if #expired > 0 then nudge() end
end
