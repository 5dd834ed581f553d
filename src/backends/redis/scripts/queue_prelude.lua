-- The queue scripts: one queue per name in the hash KEYS[1] = "turnstile:{NAME}:q":
--   'seq'        the last fencing token handed out
--   '<seq>'      an entry: "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>[ <label>]"
--                kind x|s|l, admitted 0|1, limit the Semaphore's (0 for locks), until its lease end
--   'r:<client>' what the client's latest releases did (see remember())
-- ARGV[1] is always the wake-up channel: a message there only wakes; admission is what these
-- scripts say. Anything unreadable is dropped (a hand edit, a partial write): never fail on it.
local state_key, channel = KEYS[1], ARGV[1]
local entries, last = {}, 0  -- live entries in arrival order; the largest token seen

local function entry_text(e)
  return e.kind .. (e.admitted and '1' or '0') .. ' ' .. e.permits_text .. ' ' .. e.limit_text .. ' ' .. e.request ..
         ' ' .. fmt(e.expiry) .. ' ' .. e.who
end

local function load()
  entries, last = load_hash(state_key, function(seq, field, value)
    local kind, admitted, permits, limit, request, expiry, who =
      string.match(value, '^([xsl])([01]) (%d+) (%d+) (%S+) (%d+) (.*)$')
    -- Gone once its holder stopped renewing (dead, or paused past its lease), or unreadable.
    if not kind or tonumber(expiry) <= now then return nil end
    return {seq = seq, field = field, kind = kind, admitted = admitted == '1', permits = tonumber(permits),
            permits_text = permits, limit = tonumber(limit), limit_text = limit, request = request,
            expiry = tonumber(expiry), who = who}
  end)
end

local function save() save_hash(state_key, last) end

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
