-- The queue scripts: one queue per name in the hash KEYS[1] = "turnstile:{NAME}:q":
--   'seq'        the last fencing token handed out
--   '<seq>'      an entry: "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>[ <label>]"
--                kind x|s|l, admitted 0|1, limit the Semaphore's (0 for locks), until its lease end
--   'r:<client>' what the client's latest releases did (see remember())
--   'w'          "<walk at ms> <fields>": written by every script that walks the queue (save()),
--                the earliest lease end of its entries then and the hash's field count; until
--                that time, with no field added or removed since, no entry can have expired and
--                the predicate's marks stand, so a renewal need not walk the queue (quick_renew)
-- ARGV[1] is always the wake-up channel: a message there only wakes; admission is what these
-- scripts say. Anything unreadable is dropped (a hand edit, a partial write): never fail on it.
local state_key, channel = KEYS[1], ARGV[1]
local entries, last = {}, 0  -- live entries in arrival order; the largest token seen
local request_keep_ms = nil  -- how long request records are kept beyond memory_ms (a release sets it)

local function entry_text(e)
  return e.kind .. (e.admitted and '1' or '0') .. ' ' .. e.permits_text .. ' ' .. e.limit_text .. ' ' .. e.request ..
         ' ' .. fmt(e.expiry) .. ' ' .. e.who
end

-- An entry as its text says, or nil when unreadable.
local function parse_entry(seq, field, value)
  local kind, admitted, permits, limit, request, expiry, who =
    string.match(value, '^([xsl])([01]) (%d+) (%d+) (%S+) (%d+) (.*)$')
  if not kind then return nil end
  return {seq = seq, field = field, kind = kind, admitted = admitted == '1', permits = tonumber(permits),
          permits_text = permits, limit = tonumber(limit), limit_text = limit, request = request,
          expiry = tonumber(expiry), who = who}
end

local function load()
  entries, last = load_hash(state_key, function(seq, field, value)
    local e = parse_entry(seq, field, value)
    -- Gone once its holder stopped renewing (dead, or paused past its lease), or unreadable.
    if not e or e.expiry <= now then return nil end
    return e
  end)
end

-- Writes back what changed, then 'w' (see above): the earliest lease end and the field count,
-- 'w' included (written first so that HLEN counts it). An empty queue has no 'w' (a look at a
-- name nobody uses writes nothing; the next entry's script walks).
local function save()
  if #entries == 0 then
    drop('w')
    return save_hash(state_key, last, request_keep_ms)
  end
  local walk_at = max_token
  for _, e in ipairs(entries) do walk_at = math.min(walk_at, e.expiry) end
  put('w', '0 0')
  save_hash(state_key, last, request_keep_ms)
  redis.call('HSET', state_key, 'w', fmt(walk_at) .. ' ' .. fmt(redis.call('HLEN', state_key)))
end

-- Renews the entries named by ARGV[from..] (pairs of seq and request id) without walking the
-- queue, when 'w' allows it (its time not reached, no field added or removed since by anyone
-- but a script: a hand edit, an eviction or a lost write makes the caller walk). Returns per
-- pair 0 gone or not ours, 1 waiting, 2 admitted; nil when the queue must be walked instead.
-- O(pairs): no other entry is read.
local function quick_renew(from, lease_ms)
  local walk_at, count = string.match(redis.call('HGET', state_key, 'w') or '', '^(%d+) (%d+)$')
  if not walk_at or tonumber(walk_at) <= now or tonumber(count) ~= redis.call('HLEN', state_key) then return nil end
  local earliest, set, result = tonumber(walk_at), {}, {}
  for i = from, #ARGV, 2 do
    local field, seq = ARGV[i], token_of(ARGV[i])
    local value = seq and redis.call('HGET', state_key, field)
    local e = value and parse_entry(seq, field, value)
    if e and e.request == ARGV[i + 1] then
      e.expiry = now + lease_ms
      earliest = math.min(earliest, e.expiry)  -- a shorter lease than the others' moves 'w' earlier
      set[#set + 1] = field
      set[#set + 1] = entry_text(e)
    end
    result[#result + 1] = e and e.request == ARGV[i + 1] and (e.admitted and 2 or 1) or 0
  end
  if earliest < tonumber(walk_at) then
    set[#set + 1] = 'w'
    set[#set + 1] = fmt(earliest) .. ' ' .. count
  end
  for i = 1, #set, 1000 do redis.call('HSET', state_key, unpack(set, i, math.min(i + 999, #set))) end
  return result
end

local function find(field, request)
  for i, e in ipairs(entries) do
    if e.request == request and (field == nil or e.field == field) then return i, e end
  end
end

local function remove_at(i)
  drop(entries[i].field)
  table.remove(entries, i)
end

-- The one queue predicate (evaluate_queue in Lua): walks the queue in order, marks every entry
-- it now admits, and publishes the newly admitted sequence numbers so those waiters look.
-- `quiet` is the caller's own entry, which needs no message. Sums stop at the first entry that
-- does not fit, so they stay below limit + permits: exact for values up to 2^52.
local function admit(quiet)
  local used, limit, woken = 0, nil, {}
  for position, e in ipairs(entries) do
    local fits
    if e.kind == 'l' then
      limit = limit or e.limit
      used = used + e.permits
      fits = used <= limit
    else
      fits = e.kind == 's' or position == 1
    end
    if not fits then break end
    if not e.admitted then
      e.admitted = true
      put(e.field, entry_text(e))
      if e.field ~= quiet then woken[#woken + 1] = e.field end
    end
    if e.kind == 'x' then break end
  end
  if #woken > 0 then redis.call('PUBLISH', channel, table.concat(woken, ' ')) end
end
