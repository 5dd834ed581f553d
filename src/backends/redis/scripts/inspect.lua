-- The queue as `turnstile inspect` shows it: {{seq, entry}...} in order.
if reap_expired(now_ms()) > 0 then admit(nil) end
local result = {}
for _, seq in ipairs(redis.call('ZRANGE', queue_key, 0, -1)) do
  result[#result + 1] = {tonumber(seq), redis.call('HGET', entries_key, seq)}
end
return result
