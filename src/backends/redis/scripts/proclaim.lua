-- SPDX-License-Identifier: Apache-2.0
-- Changes an election leader's value in place (Election::proclaim). ARGV: 2 the entry's seq,
-- 3 its request id (its acquire's), 4 the new value, 5 this proclaim's own request (marked: see
-- common_prelude; the same for every try of one proclaim), 6 '1' to retire that request instead
-- (its sender gave up without an answer). Returns 1 when the value was written (a resend after a
-- lost reply gets the first answer), 0 when the entry is gone, not ours, not admitted or not a
-- candidate: nothing written. A copy delivered after its sender settled or retired it changes
-- nothing (an error reply): a late proclaim never overwrites a newer one.
local seq, request, value, marked = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local client = split_request(request or '')
local _, proclaim_client = split_marked(marked or '')
if not client or proclaim_client ~= client or not token_of(seq) or not value then
  return redis.error_reply('ERR turnstile proclaim: bad arguments')
end

load()
admit(nil)
local before = recalled(marked)
if ARGV[6] == '1' then
  -- Retired (a resend of the retirement answers alike): a copy of the proclaim that comes later finds this.
  if before == nil then remember(marked, 'x') end
  save()
  return 0
end
if before == 'late' or before == 'x' then
  save()
  return given_up(marked)
end
if before then
  save()
  return tonumber(before)
end
local _, e = find(seq, request)
local result = 0
if e and e.admitted and fields['v' .. e.field] ~= nil then
  put('v' .. e.field, value)
  result = 1
end
remember(marked, fmt(result))
save()
-- Observers read the leader again on any message of the name's channel; no waiter's seq is 'v…'.
if result == 1 then redis.call('PUBLISH', channel, 'v' .. e.field) end
return result
