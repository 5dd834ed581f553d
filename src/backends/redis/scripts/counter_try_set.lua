-- trySetPermits: only when the count was never set. ARGV: 2 permits. Returns 1 or 0.
if redis.call('EXISTS', permits_key) == 1 then return 0 end
redis.call('SET', permits_key, ARGV[2])
redis.call('PUBLISH', channel, ARGV[2])
return 1
