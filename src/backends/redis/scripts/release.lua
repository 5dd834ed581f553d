-- SPDX-License-Identifier: Apache-2.0
-- Leaves the queue (a holder releasing, or a waiter giving up). ARGV: 2 seq ('' for the
-- entry of the request, whatever its seq: an acquire whose reply was lost), 3 the entry's
-- request id (its acquire's), 4 how long to remember this release (ms), 5 this release's own
-- request (marked: see common_prelude; the same for every try of one release), 6 (optional)
-- keep ms: the entry is kept, admitted, until then by the server's clock instead of removed
-- (release_after). A kept entry's request becomes 'kept', which no client's request id (they
-- all have a ':') matches: no renewal, release or late copy of any request can extend it.
-- 7 (optional, with 6) the kept end relative to the entry's expiry as the sender's last
-- confirmed renewal set it (ms, may be negative): the keep ends at the earlier of now + keep ms
-- and that, so a copy delivered late keeps no longer than an on-time one (both >= promised).
-- Returns 1 when the entry was there, or when this release already removed it (a resend after
-- a lost reply); 0 when it had expired or vanished before. Either way the acquire's request is
-- retired: a copy of it delivered late creates nothing.
local seq, request, marked = ARGV[2], ARGV[3], ARGV[5]
local client, n = split_request(request)
local _, release_client = split_marked(marked or '')
if not client or release_client ~= client then
  return redis.error_reply('ERR turnstile release: bad arguments')
end

-- What a release does, the walk's way and the index's alike, to its entry `e` (or nil), which
-- `ix` (the index; nil: the walk, `at` its place in `entries`) takes out. Returns the result
-- and the entry it kept (release_after), or nil when the index does not explain what it met.
local function release_entry(e, ix, at)
  local result, kept = 0, nil
  local before = recalled(marked)
  if before == '1' or before == '0' then
    result = tonumber(before)  -- a resend: the first try decided
  elseif before == nil then
    local keep_ms = tonumber(ARGV[6] or '')
    if e and keep_ms and keep_ms > 0 and e.admitted then
      local past_expiry = tonumber(ARGV[7] or '')
      e.expiry = past_expiry and math.min(now + keep_ms, e.expiry + past_expiry) or now + keep_ms
      e.request = 'kept'
      put(e.field, entry_text(e))
      result, kept = 1, e
    elseif e then
      if ix and not fast_path().unlink(ix, e) then return nil end
      if not ix then remove_at(at) end
      result = 1
    end
    remember(marked, fmt(result))
  end
  -- The acquire: retired while its client has not gone past it (a copy of it may still come).
  local acquire_marked = request .. ':' .. fmt(record_of(client).low)
  if recalled(acquire_marked) ~= 'late' then remember(acquire_marked, 'x') end
  request_keep_ms = tonumber(ARGV[4])
  return result, kept
end

-- A candidate that left (an election's leader, perhaps with nobody behind it): its observers read
-- the leader again. A lock's release publishes only whom it admits.
local function tell_observers(e, candidate, result, kept)
  if candidate and result == 1 and not kept then redis.call('PUBLISH', channel, 'v' .. e.field) end
end

-- Leaving through the index (see queue_prelude). Only a queue with an index ('i') takes it
-- (the others are short, or were last written by older scripts), and only a release that names
-- its entry's seq (else the acquire's reply was lost: the walk finds the entry by its request).
-- Anything the index does not explain: the script walks instead.
local F = seq ~= '' and redis.call('HEXISTS', state_key, 'i') == 1 and fast_path()
local ix = F and F.index({seq, 'p' .. seq, 'r:' .. client, 'v' .. seq})
if ix then
  F.record(client)
  local e = F.entry(seq)
  local candidate = fields['v' .. seq] ~= nil
  local result, kept = release_entry(e and e.request == request and e or nil, ix)
  local woken = {}
  if kept then ix.walk_at = math.min(ix.walk_at, kept.expiry) end
  if result and F.admit(ix, nil, woken) then
    F.save(ix, woken)
    if e then tell_observers(e, candidate, result, kept) end
    return result
  end
  F.forget()
  request_keep_ms = nil
end

load()
local at, e = find(seq ~= '' and seq or nil, request)
local candidate = e and fields['v' .. e.field] ~= nil
local result, kept = release_entry(e, nil, at)
admit(nil)
save()
if e then tell_observers(e, candidate, result, kept) end
return result
