-- Extends the leases of this client's entries of one name and reports where each stands.
-- ARGV: 2 lease ms, then pairs (seq, request id). Returns per pair: 0 gone (expired, removed,
-- or not ours: the name's state was lost), 1 waiting, 2 admitted. Waiters call it too: their
-- look after a wake-up, and the periodic one that no lost message strands them.
local lease_ms = tonumber(ARGV[2])
load()
local mine = {}
for i = 3, #ARGV, 2 do
  local _, e = find(ARGV[i], ARGV[i + 1])
  if e then
    e.expiry = now + lease_ms
    put(e.field, entry_text(e))
  end
  mine[#mine + 1] = e or false
end
-- Always walk the queue: whatever changed without a script (an entry deleted by hand, a
-- failover that lost writes), the predicate decides again here.
admit(nil)
save()
local result = {}
for i, e in ipairs(mine) do result[i] = e and (e.admitted and 2 or 1) or 0 end
return result
