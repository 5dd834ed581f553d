-- SPDX-License-Identifier: Apache-2.0
-- addPermits / release: ARGV 2 delta (may be negative), 3 the request (marked: see
-- common_prelude), 4 the largest count allowed. Returns {1, the new count}; {0, the count} when
-- the change would move the count further beyond [-max, max] (refused, nothing changed); moving
-- back toward it is always allowed, so a count a peer pushed beyond it never wedges the name.
-- Applied at most once: a resend gets the first answer, a late or given-up copy changes nothing.
local delta_text, marked, max = ARGV[2], ARGV[3], tonumber(ARGV[4])
local done, bad = load_or_recall(marked)
if bad then return bad end
if done and string.match(done, '^%-?%d+$') then return {1, tonumber(done)} end
local value = redis.call('GET', permits_key) or '0'
if done == 'n' then return {0, value} end  -- a resend of a refused change: refused again
if done then save(); return given_up(marked) end
if not string.match(value, '^%-?%d+$') then return redis.error_reply('ERR the count is not an integer: ' .. value) end
local current, delta = tonumber(value), tonumber(delta_text)
if (delta > 0 and current + delta > max) or (delta < 0 and current + delta < -max) then
  remember(marked, 'n')  -- refused: a late copy is refused too, whatever the count is then
  save()
  return {0, value}
end
local result = redis.call('INCRBY', permits_key, delta_text)
remember(marked, fmt(result))
if delta > 0 then redis.call('PUBLISH', channel, fmt(result)) end
save()
return {1, result}
