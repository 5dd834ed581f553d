-- A writer becomes a reader in place: same position, same fencing token; readers queued
-- behind it are admitted. ARGV: 2 seq. Returns 1, or 0 when the entry is gone.
local entry = redis.call('HGET', entries_key, ARGV[2])
if not entry then return 0 end
redis.call('HSET', entries_key, ARGV[2], 's' .. string.sub(entry, 2))
admit(nil)
return 1
