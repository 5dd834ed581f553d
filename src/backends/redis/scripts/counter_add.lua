-- addPermits / release: ARGV 2 delta (may be negative), 3 request id, 4 the largest count
-- allowed. Returns {1, the new count}; {0, the count} when the change would move the count
-- further beyond [-max, max] (refused, nothing changed); moving back toward it is always
-- allowed, so a count a peer pushed beyond it never wedges the name.
local delta_text, request, max = ARGV[2], ARGV[3], tonumber(ARGV[4])
local done = load_or_recall(request)
if done then return {1, done} end
local value = redis.call('GET', permits_key) or '0'
if not string.match(value, '^%-?%d+$') then return redis.error_reply('ERR the count is not an integer: ' .. value) end
local current, delta = tonumber(value), tonumber(delta_text)
if (delta > 0 and current + delta > max) or (delta < 0 and current + delta < -max) then
  return {0, value}
end
local result = redis.call('INCRBY', permits_key, delta_text)
remember(request, fmt(result), keep_ms)
if delta > 0 then redis.call('PUBLISH', channel, fmt(result)) end
save()
return {1, result}
