-- Takes permits in arrival order. ARGV: 2 permits, 3 our seq in line ('' if not queued),
-- 4 lease ms, 5 try once (1|0), 6 "<pid> <host>".
-- Returns {1} taken, {0} not taken (try once; we are not in line), {2, seq} waiting in line.
local wanted, me, lease_ms, try_once = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
local now = now_ms()
reap_expired(now)
-- A waiter whose place expired while it was paused joins again at the tail.
if me ~= '' and not redis.call('ZSCORE', waiters_key, me) then me = '' end
local head = redis.call('ZRANGE', waiters_key, 0, 0)[1]
if head == nil or head == me then
  local value = available()
  if value >= wanted then
    redis.call('DECRBY', permits_key, wanted)
    if me ~= '' then remove_waiter(me) end
    nudge()
    return {1}
  end
end
if try_once then
  if me ~= '' then
    remove_waiter(me)
    nudge()
  end
  return {0}
end
if me == '' then
  me = tostring(redis.call('INCR', counter_key))
  redis.call('ZADD', waiters_key, me, me)
  redis.call('HSET', info_key, me, ARGV[6] .. ' ' .. now)
end
redis.call('ZADD', expiry_key, now + lease_ms, me)
return {2, tonumber(me)}
