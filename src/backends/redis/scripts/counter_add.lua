-- addPermits / release: ARGV 2 delta (may be negative). Returns the new count, or
-- {err} when it would overflow (nothing changed).
local result = redis.pcall('INCRBY', permits_key, ARGV[2])
if type(result) == 'table' and result.err then return redis.error_reply('overflow: ' .. result.err) end
if tonumber(ARGV[2]) > 0 then redis.call('PUBLISH', channel, result) end
return result
