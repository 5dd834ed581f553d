-- SPDX-License-Identifier: Apache-2.0
-- The queue scripts: one queue per name in the hash KEYS[1] = "turnstile:{NAME}:q":
--   'seq'        the last fencing token handed out
--   '<seq>'      an entry: "<kind><admitted> <permits> <limit> <request> <until ms> <pid> <host> <since ms>[ <label>]"
--                kind x|s|l, admitted 0|1, limit the Semaphore's (0 for locks), until its lease end
--   'r:<client>' what the client's latest releases did (see remember())
--   'w'          "<walk at ms> <fields>": written by every script that walks the queue (save()),
--                the earliest lease end of its entries then and the hash's field count; until
--                that time, with no field added or removed since, no entry can have expired and
--                the predicate's marks stand, so a renewal need not walk the queue (quick_renew)
--   'i'          the queue's index: "<head> <tail> <first waiting> <admitted x> <admitted s> <admitted
--                permits>" (seqs, 0 for none; the admitted entries are always a prefix of the queue)
--   'p<seq>'     the entry's neighbours: "<previous seq> <next seq>" (0 for none)
--   'v<seq>'     an election candidate's value (its proposal): written with its entry, removed with
--                it (a release, a leave, its expiry); a queue whose head has one is an election
-- With the index, a join appends at the tail and a leave unlinks its entry, and admission goes on
-- from the first waiting entry: O(1) reads and writes, not a walk (join_fast, leave_fast). They
-- run only while 'w' holds (no lease can have ended, the field count is what the scripts left);
-- otherwise a script walks the queue whole as before and writes the index anew. Older scripts
-- drop 'i' and 'p<seq>' (fields they do not know) in their walk, all in one go: a missing 'i'
-- makes the next script walk, so old and new clients can share a name.
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

local index_fields = {}  -- the index fields a walk loaded: field -> true
local function load()
  local values = {}  -- the 'v<seq>' fields loaded: kept while their entry lives
  entries, last = load_hash(state_key, function(seq, field, value)
    local e = parse_entry(seq, field, value)
    -- Gone once its holder stopped renewing (dead, or paused past its lease), or unreadable.
    if not e or e.expiry <= now then return nil end
    return e
  end, function(field)
    local byte = string.byte(field)
    if (byte == 112 or byte == 118) and token_of(string.sub(field, 2)) then  -- 'p<seq>', 'v<seq>'
      if byte == 118 then values[field] = true else index_fields[field] = true end
      return true
    end
    if field ~= 'i' then return false end
    index_fields[field] = true
    return true
  end)
  for _, e in ipairs(entries) do values['v' .. e.field] = nil end
  for field in pairs(values) do drop(field) end  -- its entry expired or went without a script
end

-- What an entry makes its queue: 'semaphore', 'election' (a candidate: it has a value) or 'lock'.
local function mode_of(e)
  if e.kind == 'l' then return 'semaphore' end
  return fields['v' .. e.field] ~= nil and 'election' or 'lock'
end

-- The index's functions (see 'i' above), made on first use: a script on a short queue, which
-- keeps no index, does not pay for making them (about 3 µs a call, measured). The fast path's
-- reads go field by field through `fields`, so a field this script put or dropped reads as it
-- now is; nothing is written before the end (F.save), so a fast step that meets something the
-- index does not explain returns nil and the script walks instead, after F.forget().
local index_from = 8  -- see F.rebuild

local fast = nil
local function fast_path()
  if fast then return fast end
  local F = {}
  function F.text(ix)
    return ix.head .. ' ' .. ix.tail .. ' ' .. ix.fw .. ' ' .. fmt(ix.ax) .. ' ' .. fmt(ix.as) .. ' ' .. fmt(ix.ap)
  end

  -- Counts entry e in (sign 1) or out of (-1) the admitted prefix's totals.
  function F.count(ix, e, sign)
    if e.kind == 'x' then ix.ax = ix.ax + sign elseif e.kind == 's' then ix.as = ix.as + sign
    else ix.ap = ix.ap + sign * e.permits end
  end

  -- After a walk: the index of `entries` as they now stand, written where it differs from the
  -- hash (an unchanged queue writes nothing); index fields of entries gone are dropped. A queue
  -- of `index_from` entries or fewer keeps none: walking it costs about what the index's reads
  -- do, and an uncontended lock and release then write nothing more than before the index.
  function F.rebuild()
    local want = {}
    if #entries > index_from then
      local ix = {head = entries[1].field, tail = entries[#entries].field, fw = '0', ax = 0, as = 0, ap = 0}
      for i, e in ipairs(entries) do
        local before, after = entries[i - 1], entries[i + 1]
        want['p' .. e.field] = (before and before.field or '0') .. ' ' .. (after and after.field or '0')
        if e.admitted then F.count(ix, e, 1) elseif ix.fw == '0' then ix.fw = e.field end
      end
      want['i'] = F.text(ix)
    end
    for field in pairs(index_fields) do
      if want[field] == nil then drop(field) end
    end
    for field, value in pairs(want) do
      if fields[field] ~= value then put(field, value) end
    end
  end

  local fetched = {}  -- fields the fast path read one by one: their values (nil: absent) are in `fields`
  -- Reads those of `list` not read, put or dropped yet, in one HMGET ('0' and 'p0' name nothing).
  function F.fetch(list)
    local wanted = {}
    for _, field in ipairs(list) do
      if field ~= '0' and field ~= 'p0' and not fetched[field] and not deletes[field] and fields[field] == nil then
        wanted[#wanted + 1] = field
        fetched[field] = true
      end
    end
    if #wanted == 0 then return end
    local values = redis.call('HMGET', state_key, unpack(wanted))
    for i, field in ipairs(wanted) do fields[field] = values[i] or nil end
  end
  function F.get(field)
    F.fetch({field})
    return fields[field]
  end

  -- The index when the fast path may use it: 'w' holds (see quick_renew) and 'i' is readable.
  -- `prefetch`: fields the caller will read, fetched in the same HMGET.
  function F.index(prefetch)
    prefetch[#prefetch + 1] = 'w'
    prefetch[#prefetch + 1] = 'i'
    F.fetch(prefetch)
    local walk_at, count = string.match(fields['w'] or '', '^(%d+) (%d+)$')
    local head, tail, fw, ax, as, ap = string.match(fields['i'] or '', '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
    if not walk_at or tonumber(walk_at) <= now or not head or head == '0' or
       tonumber(count) ~= redis.call('HLEN', state_key) then
      return nil
    end
    return {walk_at = tonumber(walk_at), head = head, tail = tail, fw = fw, ax = tonumber(ax), as = tonumber(as),
            ap = tonumber(ap)}
  end

  function F.entry(field)
    local value = field ~= '0' and F.get(field)
    return value and parse_entry(token_of(field), field, value) or nil
  end
  -- The entry's neighbours, nil when its link is missing or unreadable.
  function F.links(field)
    return string.match(F.get('p' .. field) or '', '^(%d+) (%d+)$')
  end
  -- The client's request record, reaped when stale as load_hash would (read with the index).
  function F.record(client)
    local value = fields['r:' .. client]
    if value then load_record('r:' .. client, value) end
  end
  function F.forget()
    fields, writes, deletes, records, fetched = {}, {}, {}, {}, {}
  end

  function F.set_link(field, before, after) put('p' .. field, before .. ' ' .. after) end

  -- Appends e at the tail. False when the tail's link is missing.
  function F.append(ix, e)
    local tail_before = F.links(ix.tail)
    if not tail_before then return false end
    put(e.field, entry_text(e))
    F.set_link(e.field, ix.tail, '0')
    F.set_link(ix.tail, tail_before, e.field)
    ix.tail = e.field
    if ix.fw == '0' then ix.fw = e.field end
    return true
  end

  -- Takes e out of the queue, its neighbours linked to each other. False when a link is missing.
  function F.unlink(ix, e)
    local before, after = F.links(e.field)
    if not before then return false end
    F.fetch({'p' .. before, 'p' .. after, after, ix.fw, 'p' .. ix.fw})
    local before_before, after_after = '0', '0'
    if before ~= '0' then before_before = F.links(before) end
    if after ~= '0' then after_after = select(2, F.links(after)) end
    if not before_before or not after_after then return false end
    if before ~= '0' then F.set_link(before, before_before, after) else ix.head = after end
    if after ~= '0' then F.set_link(after, before, after_after) else ix.tail = before end
    if e.admitted then F.count(ix, e, -1) elseif ix.fw == e.field then ix.fw = after end
    drop(e.field)
    drop('p' .. e.field)
    drop('v' .. e.field)  -- an election candidate's value, if it is one
    return true
  end

  -- admit() from the first waiting entry on: the same predicate, told by the admitted prefix's
  -- totals instead of a sum over the queue. Appends to `woken` whom it admits (but `quiet`).
  -- False when the index does not match the entries.
  function F.admit(ix, quiet, woken)
    while ix.fw ~= '0' do
      local e, _, after = F.entry(ix.fw), F.links(ix.fw)
      if not e or not after or e.admitted then return false end
      local fits
      if e.kind == 'l' then fits = ix.ap + e.permits <= e.limit
      elseif e.kind == 's' then fits = ix.ax == 0
      else fits = ix.ax + ix.as == 0 end
      if not fits then break end
      e.admitted = true
      put(e.field, entry_text(e))
      if e.field ~= quiet then woken[#woken + 1] = e.field end
      F.count(ix, e, 1)
      ix.fw = after
      if e.kind == 'x' then break end
    end
    return true
  end

  -- Writes what the fast step changed, the index and 'w' (its field count read after the write:
  -- 'w' itself is already there), and wakes whom it admitted.
  function F.save(ix, woken)
    if ix.head == '0' then
      drop('i')
      drop('w')  -- an empty queue has no 'w', as after a walk
    else
      put('i', F.text(ix))
    end
    if last > 0 and last > (token_of(F.get('seq')) or 0) then put('seq', fmt(last)) end
    save_records(request_keep_ms)
    flush(state_key)
    if ix.head ~= '0' then
      redis.call('HSET', state_key, 'w', fmt(ix.walk_at) .. ' ' .. fmt(redis.call('HLEN', state_key)))
    end
    if #woken > 0 then redis.call('PUBLISH', channel, table.concat(woken, ' ')) end
  end
  fast = F
  return F
end

-- Writes back what changed, with 'w' (see above): the earliest lease end and the field count
-- after the write, 'w' included (field_count(): the hash was read whole), in the same HSET;
-- unchanged, 'w' is not written. An empty queue has no 'w' (a look at a name nobody uses
-- writes nothing; the next entry's script walks).
local function save()
  if #entries > index_from or next(index_fields) then fast_path().rebuild() end
  if #entries == 0 then
    drop('w')
    return save_hash(state_key, last, request_keep_ms)
  end
  local walk_at = max_token
  for _, e in ipairs(entries) do walk_at = math.min(walk_at, e.expiry) end
  save_hash(state_key, last, request_keep_ms, function()
    if fields['w'] == nil then put('w', '') end  -- counted
    local w = fmt(walk_at) .. ' ' .. fmt(field_count())
    if fields['w'] ~= w then put('w', w) end
  end)
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
  if fields['v' .. entries[i].field] ~= nil then drop('v' .. entries[i].field) end
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
