-- Extends the leases of this client's entries of one name and reports where each stands.
-- ARGV: 2 lease ms, 3.. seqs. Returns per seq: 0 gone (expired or removed), 1 waiting,
-- 2 admitted. Waiters call it too: their periodic re-check that no lost message strands them.
local now = now_ms()
reap_expired(now)
-- Always walk the queue: whatever changed without a script (an entry deleted by hand, a
-- failover that lost writes), the predicate decides again here.
admit(nil)
local lease_ms = tonumber(ARGV[2])
local result = {}
for i = 3, #ARGV do
  local entry = redis.call('HGET', entries_key, ARGV[i])
  if entry then
    redis.call('ZADD', expiry_key, 'XX', now + lease_ms, ARGV[i])
    result[#result + 1] = string.sub(entry, 2, 2) == '1' and 2 or 1
  else
    result[#result + 1] = 0
  end
end
return result
