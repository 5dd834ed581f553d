-- SPDX-License-Identifier: Apache-2.0
-- Retires a request whose sender gave up without an answer (the background clean-up retries
-- this until it is answered): whatever of it arrives later changes nothing. ARGV: 2 the
-- request (marked), 3 the permits its take would have taken ('0' for addPermits, drain or
-- trySet). A take it made is given back (its caller was told "not taken"); a place it holds in
-- line goes. Returns 1.
local marked, refund = ARGV[2], ARGV[3]
local done, bad = load_or_recall(marked)
if bad then return bad end
if done == nil then
  local request = split_marked(marked)
  for i, w in ipairs(waiters) do
    if w.request == request then
      remove_waiter(i)
      nudge()
      break
    end
  end
  remember(marked, 'x')
elseif done == '1' and refund ~= '0' then
  local count = redis.call('INCRBY', permits_key, refund)
  redis.call('PUBLISH', channel, fmt(count))
  remember(marked, 'r')  -- given back once
end
save()
return 1
