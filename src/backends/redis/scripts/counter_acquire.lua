-- SPDX-License-Identifier: Apache-2.0
-- Takes permits in arrival order. ARGV: 2 permits, 3 lease ms, 4 mode (0 wait, 1 try once,
-- 2 only leave the line), 5 "<pid> <host>", 6 the request (marked: see common_prelude; the same
-- for every look of one acquire call), 7 " <holder label>" or "". Returns {1} taken (now, or by
-- an earlier look whose reply was lost), {0} not taken (try once, or leave: we left the line),
-- {2, seq, head seq} waiting. A leave is remembered: a look of the same request delivered after
-- it (its sender gave up) takes nothing and joins no line.
local wanted, lease_ms, mode, marked = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[6]
local try_once = mode ~= '0'
local done, bad = load_or_recall(marked)
if bad then return bad end
if done == '1' then return {1} end  -- a resend: the permits were taken already
if done then
  save()
  return {0}  -- left, retired, or its client went on: a late look changes nothing
end
local request = split_marked(marked)
local me
for i, w in ipairs(waiters) do
  if w.request == request then me = i end
end
local function leave_line()
  if me then
    remove_waiter(me)
    nudge()
  end
  remember(marked, '0')
  save()
  return {0}
end
if mode == '2' then return leave_line() end
-- Only the first in line (or a newcomer to an empty line) may take permits.
if (me == nil and #waiters == 0) or me == 1 then
  if available() >= wanted then
    redis.call('DECRBY', permits_key, ARGV[2])
    if me then remove_waiter(me) end
    remember(marked, '1')
    nudge()
    save()
    return {1}
  end
end
if reaped then nudge() end
if try_once then return leave_line() end
local w = me and waiters[me]
if not w then
  last = next_token(last, 0)
  if not last then return exhausted() end
  w = {seq = last, field = fmt(last), request = request, who = ARGV[5] .. ' ' .. fmt(now) .. (ARGV[7] or '')}
  waiters[#waiters + 1] = w
end
w.expiry = now + lease_ms
put(w.field, fmt(w.expiry) .. ' ' .. w.request .. ' ' .. w.who)
save()
return {2, w.seq, waiters[1].seq}
