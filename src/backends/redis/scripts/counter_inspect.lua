-- SPDX-License-Identifier: Apache-2.0
-- The PermitCounter's value (false when never set) and its waiters {seq, "<pid> <host>
-- <since ms>"} in order.
load()
if reaped then nudge() end
save()
local result = {redis.call('GET', permits_key)}
for _, w in ipairs(waiters) do result[#result + 1] = {w.seq, w.who} end
return result
