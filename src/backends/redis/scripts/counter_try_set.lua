-- SPDX-License-Identifier: Apache-2.0
-- trySetPermits: only when the count was never set. ARGV: 2 permits, 3 the request (marked).
-- Returns 1 or 0. At most once, as counter_add.
local done, bad = load_or_recall(ARGV[3])
if bad then return bad end
if done == '1' or done == '0' then return tonumber(done) end
if done then save(); return given_up(ARGV[3]) end
local result = 0
if redis.call('EXISTS', permits_key) == 0 then
  redis.call('SET', permits_key, ARGV[2])
  redis.call('PUBLISH', channel, ARGV[2])
  result = 1
end
remember(ARGV[3], fmt(result))
save()
return result
