-- Leaves the queue (a holder releasing, or a waiter giving up). ARGV: 2 seq.
-- Returns 1 when the entry was there, 0 when it had already expired or vanished.
local seq = ARGV[2]
local entry = redis.call('HGET', entries_key, seq)
if entry then remove_entry(seq, entry) end
if redis.call('ZCARD', queue_key) > 0 then
  reap_expired(now_ms())
  admit(nil)
end
return entry and 1 or 0
