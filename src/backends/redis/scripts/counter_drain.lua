-- SPDX-License-Identifier: Apache-2.0
-- drainPermits: the count becomes 0; returns what it was (0 when never set, left unset).
-- ARGV: 2 the request (marked). At most once, as counter_add.
local done, bad = load_or_recall(ARGV[2])
if bad then return bad end
if done and string.match(done, '^%-?%d+$') then return tonumber(done) end
if done then save(); return given_up(ARGV[2]) end
local value = redis.call('GET', permits_key)
local was = value and tonumber(string.match(value, '^%-?%d+$') and value) or 0
if value then redis.call('SET', permits_key, 0) end
remember(ARGV[2], fmt(was))
save()
return was
