-- The PermitCounter's value (false when never set) and its waiters {seq, info} in order.
reap_expired(now_ms())
local result = {redis.call('GET', permits_key)}
for _, seq in ipairs(redis.call('ZRANGE', waiters_key, 0, -1)) do
  result[#result + 1] = {tonumber(seq), redis.call('HGET', info_key, seq) or ''}
end
return result
