-- SPDX-License-Identifier: Apache-2.0
-- Joins the queue. ARGV: 2 kind (x|s|l), 3 permits, 4 limit (leases), 5 lease ms,
-- 6 try once (1|0), 7 the request (marked: see common_prelude), 8 "<pid> <host>", 9 " <holder
-- label>" or "", 10 (an election candidate's only) its value, written as 'v<seq>'. Returns
-- {1, seq} admitted, {2, seq} waiting, {0} not admitted on a try-once (nothing changed but this
-- request's record), {-1, mode} kind mismatch, {-2, limit} limit mismatch; an error reply when
-- the request was released, left or settled before (a late copy: nothing is created).
local kind, permits_text, limit_text, lease_ms = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local try_once, marked = ARGV[6] == '1', ARGV[7]
local request = split_marked(marked)
if not string.match(kind, '^[xsl]$') or not string.match(permits_text, '^%d+$') or
   not string.match(limit_text, '^%d+$') or not lease_ms or not request then
  return redis.error_reply('ERR turnstile acquire: bad arguments')
end
local permits, limit = tonumber(permits_text), tonumber(limit_text)
local value = ARGV[10]  -- nil: not an election candidate
local wanted = kind == 'l' and 'semaphore' or (value and 'election' or 'lock')

-- This request's entry, not yet admitted, with the next fencing token: larger than any handed
-- out on this state, and than the server's clock in microseconds, so it still grows when the
-- name's state was lost (evicted, deleted, restarted from an older snapshot): see
-- docs/backends/redis.md, how it works, for the clock condition. Nil when tokens ran out.
local function new_entry()
  local seq = next_token(last, now_us)
  if not seq then return nil end
  last = seq
  return {seq = seq, field = fmt(seq), kind = kind, admitted = false, permits = permits, permits_text = permits_text,
          limit = limit, limit_text = limit_text, request = request, expiry = now + lease_ms,
          who = ARGV[8] .. ' ' .. fmt(now) .. (ARGV[9] or '')}
end

-- A candidate that leads at once: the election's observers read the leader again (a lock's
-- waiters hear nothing: no waiter's seq is 'v…', and a lock entry publishes nothing here).
local function tell_observers(e)
  if value and string.sub(fields[e.field] or '', 2, 2) == '1' then redis.call('PUBLISH', channel, 'v' .. e.field) end
end

-- Joining at the back through the index (see queue_prelude). Only a queue with an index ('i')
-- takes it (the others are short, or were last written by older scripts), and only a request
-- not known before (a resend or a late copy walks: the walk finds its entry). Anything the
-- index does not explain: the script walks instead. (Its functions are made only here: a
-- short queue's join does not pay for them.)
local F = redis.call('HEXISTS', state_key, 'i') == 1 and fast_path()
local client = F and string.match(request, '^([0-9a-f]+):')
local ix = F and F.index({'r:' .. client, 'seq'})
if ix then
  -- The answer, or nil to walk.
  local function join_fast()
    F.record(client)
    if recalled(marked) ~= nil then return nil end
    F.fetch({ix.head, 'p' .. ix.tail, ix.fw, 'p' .. ix.fw, 'v' .. ix.head})
    local head = F.entry(ix.head)
    if not head then return nil end
    local function decided_fast(answer)
      remember(marked, 'd')
      F.save(ix, {})
      return answer
    end
    if mode_of(head) ~= wanted then return decided_fast({-1, mode_of(head)}) end
    if head.kind == 'l' and head.limit ~= limit then return decided_fast({-2, head.limit_text}) end
    -- A try-once joins only when the predicate admits it at the tail: nobody waits (the first
    -- waiting entry did not fit), and what is admitted leaves room.
    if try_once and (kind == 'x' or ix.fw ~= '0' or (kind == 's' and ix.ax > 0) or
                     (kind == 'l' and ix.ap + permits > limit)) then
      return decided_fast({0})
    end
    last = math.max(token_of(F.get('seq') or '') or 0, token_of(ix.tail) or 0)
    local e = new_entry()
    if not e then return exhausted() end
    local woken = {}
    if not F.append(ix, e) or not F.admit(ix, e.field, woken) then return nil end
    if value then put('v' .. e.field, value) end
    remember(marked, 'j')
    ix.walk_at = math.min(ix.walk_at, e.expiry)
    F.save(ix, woken)
    tell_observers(e)
    return {string.sub(fields[e.field], 2, 2) == '1' and 1 or 2, e.seq}
  end
  local answer = join_fast()
  if answer then return answer end
  F.forget()
end

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
  if first and mode_of(first) ~= wanted then return decided({-1, mode_of(first)}) end
  if first and first.kind == 'l' and first.limit ~= limit then return decided({-2, first.limit_text}) end
  return decided({0})
end
local first = entries[1]
if first then
  -- The queue's mode is its head's: locks (x, s), leases of one limit, or candidates (x with a value).
  if mode_of(first) ~= wanted then return decided({-1, mode_of(first)}) end
  if first.kind == 'l' and first.limit ~= limit then return decided({-2, first.limit_text}) end
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

local e = new_entry()
if not e then return exhausted() end
entries[#entries + 1] = e
put(e.field, entry_text(e))
if value then put('v' .. e.field, value) end
remember(marked, 'j')  -- joined: once the entry is gone, a late copy finds this
admit(e.field)
save()
tell_observers(e)
return {e.admitted and 1 or 2, e.seq}
