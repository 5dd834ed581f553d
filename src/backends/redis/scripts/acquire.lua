-- Joins the queue. ARGV: 2 kind (x|s|l), 3 permits, 4 limit (leases), 5 lease ms,
-- 6 try once (1|0), 7 the request (marked: see common_prelude), 8 "<pid> <host>", 9 " <holder
-- label>" or "". Returns {1, seq} admitted, {2, seq} waiting, {0} not admitted on a try-once
-- (nothing changed but this request's record), {-1, mode} kind mismatch, {-2, limit} limit
-- mismatch; an error reply when the request was released, left or settled before (a late
-- copy: nothing is created).
local kind, permits_text, limit_text, lease_ms = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local try_once, marked = ARGV[6] == '1', ARGV[7]
local request = split_marked(marked)
if not string.match(kind, '^[xsl]$') or not string.match(permits_text, '^%d+$') or
   not string.match(limit_text, '^%d+$') or not lease_ms or not request then
  return redis.error_reply('ERR turnstile acquire: bad arguments')
end
local permits, limit = tonumber(permits_text), tonumber(limit_text)
load()
admit(nil)  -- entries that expired may have let others in

-- A resend after a lost reply finds the entry it already made.
local _, mine = find(nil, request)
if mine then
  save()
  return {mine.admitted and 1 or 2, mine.seq}
end
-- No entry, but the request is known: its entry was released or left (or it was retired with
-- no entry), or its client went on past it. A late copy creates nothing.
local before = recalled(marked)
if before and before ~= 'd' then
  save()
  return given_up(marked)
end

-- Decided without an entry: remembered, so that a copy of it decides nothing else (a resend
-- after a lost reply decides again, but never makes an entry).
local function decided(answer)
  remember(marked, 'd')
  save()
  return answer
end
if before == 'd' then
  local first = entries[1]
  if first and (first.kind == 'l') ~= (kind == 'l') then return decided({-1, first.kind == 'l' and 'semaphore' or 'lock'}) end
  if first and first.kind == 'l' and first.limit ~= limit then return decided({-2, first.limit_text}) end
  return decided({0})
end
local first = entries[1]
if first then
  -- The queue's mode is its entries' kind: locks (x, s) or leases of one limit.
  local is_semaphore = first.kind == 'l'
  if is_semaphore ~= (kind == 'l') then return decided({-1, is_semaphore and 'semaphore' or 'lock'}) end
  if is_semaphore and first.limit ~= limit then return decided({-2, first.limit_text}) end
  if try_once then
    -- Would the predicate admit us at the tail? Then join; otherwise change nothing.
    local used = permits
    for _, e in ipairs(entries) do
      if kind ~= 'l' and (kind == 'x' or e.kind == 'x') then return decided({0}) end
      used = used + e.permits
      if kind == 'l' and used > limit then return decided({0}) end
    end
  end
end

-- The fencing token: larger than any handed out on this state, and than the server's clock
-- in microseconds, so it still grows when the name's state was lost (evicted, deleted,
-- restarted from an older snapshot): see docs/backends/redis.md, how it works, for the clock condition.
local seq = next_token(last, now_us)
if not seq then return exhausted() end
last = seq
local e = {seq = seq, field = fmt(seq), kind = kind, admitted = false, permits = permits, permits_text = permits_text,
           limit = limit, limit_text = limit_text, request = request, expiry = now + lease_ms,
           who = ARGV[8] .. ' ' .. fmt(now) .. (ARGV[9] or '')}
entries[#entries + 1] = e
put(e.field, entry_text(e))
remember(marked, 'j')  -- joined: once the entry is gone, a late copy finds this
admit(e.field)
save()
return {e.admitted and 1 or 2, seq}
