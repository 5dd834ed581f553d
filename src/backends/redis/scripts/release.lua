-- Leaves the queue (a holder releasing, or a waiter giving up). ARGV: 2 seq ('' for the
-- entry of the request, whatever its seq: an acquire whose reply was lost), 3 the entry's
-- request id, 4 how long to remember this release (ms).
-- Returns 1 when the entry was there, or when this release already removed it (a resend after
-- a lost reply); 0 when it had expired or vanished before.
local seq, request, keep_ms = ARGV[2], ARGV[3], tonumber(ARGV[4])
load()
local i = find(seq ~= '' and seq or nil, request)
local result = 0
if i then
  remove_at(i)
  remember(request, '1', keep_ms)
  result = 1
elseif recalled(request) == '1' then
  result = 1
end
admit(nil)
save()
return result
