-- Joins the queue. ARGV: 2 kind (x|s|l), 3 permits, 4 limit (leases), 5 lease ms,
-- 6 try once (1|0), 7 request id, 8 "<pid> <host>".
-- Returns {1, seq} admitted, {2, seq} waiting, {0} not admitted on a try-once (nothing
-- changed), {-1, mode} kind mismatch, {-2, limit} limit mismatch.
local kind, permits, limit, lease_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local try_once, request = ARGV[6] == '1', ARGV[7]
local now = now_ms()

-- A retry after a lost reply finds the entry it already made.
local existing = redis.call('HGET', requests_key, request)
if existing then
  local entry = redis.call('HGET', entries_key, existing)
  if entry then return {string.sub(entry, 2, 2) == '1' and 1 or 2, tonumber(existing)} end
end

local admitted = '1'
if redis.call('ZCARD', queue_key) > 0 then
  if reap_expired(now) > 0 then admit(nil) end
  local first = redis.call('ZRANGE', queue_key, 0, 0)[1]
  if first then
    -- The queue's mode is its entries' kind: locks (x, s) or leases of one limit.
    local first_kind, _, _, first_limit = parse(redis.call('HGET', entries_key, first))
    local is_semaphore = first_kind == 'l'
    if is_semaphore ~= (kind == 'l') then return {-1, is_semaphore and 'semaphore' or 'lock'} end
    if is_semaphore and first_limit ~= limit then return {-2, first_limit} end
    admitted = '0'  -- decided by the walk below
    if try_once then
      -- Would the predicate admit us at the tail? Then join; otherwise change nothing.
      local used = permits
      for _, seq in ipairs(redis.call('ZRANGE', queue_key, 0, -1)) do
        local other, _, other_permits = parse(redis.call('HGET', entries_key, seq))
        if kind ~= 'l' and (kind == 'x' or other == 'x') then return {0} end
        used = used + other_permits
      end
      if kind == 'l' and used > limit then return {0} end
    end
  end
end

local seq = redis.call('INCR', counter_key)
redis.call('ZADD', queue_key, seq, seq)
redis.call('HSET', entries_key, seq, kind .. admitted .. ' ' .. permits .. ' ' .. limit .. ' ' .. request .. ' ' .. ARGV[8] .. ' ' .. now)
redis.call('ZADD', expiry_key, now + lease_ms, seq)
redis.call('HSET', requests_key, request, seq)
if admitted == '1' then return {1, seq} end
admit(tostring(seq))
local entry = redis.call('HGET', entries_key, seq)
return {string.sub(entry, 2, 2) == '1' and 1 or 2, seq}
