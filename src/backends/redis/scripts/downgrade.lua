-- SPDX-License-Identifier: Apache-2.0
-- A writer becomes a reader in place: same position, same fencing token; readers queued
-- behind it are admitted. ARGV: 2 seq, 3 request id. Returns 1, or 0 when the entry is gone.
load()
local _, e = find(ARGV[2], ARGV[3])
if e then
  e.kind = 's'
  put(e.field, entry_text(e))
end
admit(nil)
save()
return e and 1 or 0
