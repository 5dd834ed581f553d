-- Leaves the queue (a holder releasing, or a waiter giving up). ARGV: 2 seq.
-- Returns 1 when the entry was there, 0 when it had already expired or vanished.
local seq = ARGV[2]
reap_expired(now_ms())
local present = redis.call('HEXISTS', entries_key, seq) == 1
if present then remove_entry(seq) end
admit(nil)
return present and 1 or 0
