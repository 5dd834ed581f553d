-- trySetPermits: only when the count was never set. ARGV: 2 permits, 3 request id.
-- Returns 1 or 0.
local done = load_or_recall(ARGV[3])
if done then return done end
local result = 0
if redis.call('EXISTS', permits_key) == 0 then
  redis.call('SET', permits_key, ARGV[2])
  redis.call('PUBLISH', channel, ARGV[2])
  result = 1
end
remember(ARGV[3], fmt(result), keep_ms)
save()
return result
