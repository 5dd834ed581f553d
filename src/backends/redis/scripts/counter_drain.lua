-- drainPermits: the count becomes 0; returns what it was (0 when never set, left unset).
local value = redis.call('GET', permits_key)
if not value then return 0 end
redis.call('SET', permits_key, 0)
return tonumber(value)
