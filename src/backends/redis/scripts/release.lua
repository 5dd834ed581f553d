-- Leaves the queue (a holder releasing, or a waiter giving up). ARGV: 2 seq ('' for the
-- entry of the request, whatever its seq: an acquire whose reply was lost), 3 the entry's
-- request id (its acquire's), 4 how long to remember this release (ms), 5 this release's own
-- request (marked: see common_prelude; the same for every try of one release).
-- Returns 1 when the entry was there, or when this release already removed it (a resend after
-- a lost reply); 0 when it had expired or vanished before. Either way the acquire's request is
-- retired: a copy of it delivered late creates nothing.
local seq, request, marked = ARGV[2], ARGV[3], ARGV[5]
local client, n = split_request(request)
local _, release_client = split_marked(marked or '')
if not client or release_client ~= client then
  return redis.error_reply('ERR turnstile release: bad arguments')
end
load()
local result = 0
local before = recalled(marked)
if before == '1' or before == '0' then
  result = tonumber(before)  -- a resend: the first try decided
elseif before == nil then
  local i = find(seq ~= '' and seq or nil, request)
  if i then
    remove_at(i)
    result = 1
  end
  remember(marked, fmt(result))
end
-- The acquire: retired while its client has not gone past it (a copy of it may still come).
local acquire_marked = request .. ':' .. fmt(record_of(client).low)
if recalled(acquire_marked) ~= 'late' then remember(acquire_marked, 'x') end
request_keep_ms = tonumber(ARGV[4])
admit(nil)
save()
return result
