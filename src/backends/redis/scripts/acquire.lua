-- Joins the queue. ARGV: 2 kind (x|s|l), 3 permits, 4 limit (leases), 5 lease ms,
-- 6 try once (1|0), 7 request id, 8 "<pid> <host>".
-- Returns {1, seq} admitted, {2, seq} waiting, {0} not admitted on a try-once (nothing
-- changed), {-1, mode} kind mismatch, {-2, limit} limit mismatch.
local kind, permits, limit, lease_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local try_once, request = ARGV[6] == '1', ARGV[7]
local now = now_ms()
if reap_expired(now) > 0 then admit(nil) end

-- A retry after a lost reply finds the entry it already made.
local existing = redis.call('HGET', requests_key, request)
if existing then
  local entry = redis.call('HGET', entries_key, existing)
  return {string.sub(entry, 2, 2) == '1' and 1 or 2, tonumber(existing)}
end

local wanted = kind == 'l' and 'semaphore' or 'lock'
local mode = redis.call('HMGET', mode_key, 'kind', 'limit')
if mode[1] then
  if mode[1] ~= wanted then return {-1, mode[1]} end
  if wanted == 'semaphore' and tonumber(mode[2]) ~= limit then return {-2, tonumber(mode[2])} end
end

if try_once then
  -- Would the predicate admit us at the tail? Then join; otherwise change nothing.
  local seqs = redis.call('ZRANGE', queue_key, 0, -1)
  local used = permits
  for _, seq in ipairs(seqs) do
    local entry = redis.call('HGET', entries_key, seq)
    local other = string.sub(entry, 1, 1)
    if wanted == 'lock' and (kind == 'x' or other == 'x') then return {0} end
    used = used + tonumber(string.sub(entry, 4))
  end
  if wanted == 'semaphore' and used > limit then return {0} end
end

if not mode[1] then redis.call('HSET', mode_key, 'kind', wanted, 'limit', limit) end
local seq = redis.call('INCR', counter_key)
redis.call('ZADD', queue_key, seq, seq)
redis.call('HSET', entries_key, seq, kind .. '0 ' .. permits)
redis.call('ZADD', expiry_key, now + lease_ms, seq)
redis.call('HSET', info_key, seq, request .. ' ' .. ARGV[8] .. ' ' .. now)
redis.call('HSET', requests_key, request, seq)
admit(tostring(seq))
local entry = redis.call('HGET', entries_key, seq)
return {string.sub(entry, 2, 2) == '1' and 1 or 2, seq}
