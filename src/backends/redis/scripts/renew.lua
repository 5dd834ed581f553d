-- SPDX-License-Identifier: Apache-2.0
-- Extends the leases of this client's entries of one name and reports where each stands.
-- ARGV: 2 lease ms, then pairs (seq, request id). Returns per pair: 0 gone (expired, removed,
-- or not ours: the name's state was lost), 1 waiting, 2 admitted. The watchdog renews all of a
-- client's entries of the name in one call each round (holds and waiters); a waiter also calls
-- it for its own entry when it looks (woken by a message or by the watchdog).
local lease_ms = tonumber(ARGV[2])
-- Nothing expired and nothing changed behind the scripts' back: only our own entries are read.
local quick = quick_renew(3, lease_ms)
if quick then return quick end
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
-- Walk the queue: an entry expired (its holder dead, or paused past its lease), or something
-- changed without a script (an entry deleted by hand, a failover that lost writes): the
-- predicate decides again here, and publishes whom it admits.
admit(nil)
save()
local result = {}
for i, e in ipairs(mine) do result[i] = e and (e.admitted and 2 or 1) or 0 end
return result
