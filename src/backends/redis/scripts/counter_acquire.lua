-- Takes permits in arrival order. ARGV: 2 permits, 3 lease ms, 4 mode (0 wait, 1 try once,
-- 2 only leave the line), 5 "<pid> <host>", 6 request id (the same for every look of one
-- acquire call), 7 " <holder label>" or "". Returns {1} taken (now, or by an earlier look
-- whose reply was lost), {0} not taken (try once, or leave: we left the line), {2, seq, head
-- seq} waiting.
local wanted, lease_ms, mode, request = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[6]
local try_once = mode ~= '0'
if load_or_recall(request) == 1 then return {1} end  -- a resend: the permits were taken already
local me
for i, w in ipairs(waiters) do
  if w.request == request then me = i end
end
local function leave_line()
  if me then
    remove_waiter(me)
    nudge()
  end
  save()
  return {0}
end
if mode == '2' then return leave_line() end
-- Only the first in line (or a newcomer to an empty line) may take permits.
if (me == nil and #waiters == 0) or me == 1 then
  if available() >= wanted then
    redis.call('DECRBY', permits_key, ARGV[2])
    if me then remove_waiter(me) end
    remember(request, '1', keep_ms)
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
