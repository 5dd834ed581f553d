-- drainPermits: the count becomes 0; returns what it was (0 when never set, left unset).
-- ARGV: 2 request id.
local done = load_or_recall(ARGV[2])
if done then return done end
local value = redis.call('GET', permits_key)
local was = value and tonumber(string.match(value, '^%-?%d+$') and value) or 0
if value then redis.call('SET', permits_key, 0) end
remember(ARGV[2], fmt(was), keep_ms)
save()
return was
