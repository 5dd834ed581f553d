-- The queue as `turnstile inspect` shows it: {mode, limit, {seq, entry, info}...}.
if reap_expired(now_ms()) > 0 then admit(nil) end
local mode = redis.call('HMGET', mode_key, 'kind', 'limit')
local result = {mode[1] or '', tonumber(mode[2]) or 0}
for _, seq in ipairs(redis.call('ZRANGE', queue_key, 0, -1)) do
  result[#result + 1] = {tonumber(seq), redis.call('HGET', entries_key, seq), redis.call('HGET', info_key, seq) or ''}
end
return result
