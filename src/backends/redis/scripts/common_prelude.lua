-- SPDX-License-Identifier: Apache-2.0
-- Shared head of every script (prepended at build time; Redis scripts cannot include).
-- Each family keeps what one name needs in ONE hash, so that eviction or deletion takes all of
-- it or nothing; scripts read it whole (HGETALL), decide, and write back only what changed.
-- Numbers travel as decimal text and are printed with '%d' (Lua 5.1's tostring prints 1e+14).
local function fmt(n) return string.format('%d', n) end

-- Fencing tokens and places in line stay below 2^53, where Lua's doubles are exact integers:
-- so tokens are exact and strictly increasing, and '%d' prints them exactly.
local max_token = 9007199254740991
-- A token as stored: canonical decimal digits, 1..max_token; nil for anything else (a hand
-- edit, '1e300', 'inf', '-5', a number too large to be exact).
local function token_of(text)
  if type(text) ~= 'string' or #text > 16 or not string.match(text, '^[1-9]%d*$') then return nil end
  local n = tonumber(text)
  if n > max_token then return nil end
  return n
end
-- The next token after `last`, at least `floor`; nil when it would pass max_token (the caller
-- refuses with exhausted(), before anything is written).
local function next_token(last, floor)
  local n = math.max(last + 1, floor)
  if n > max_token then return nil end
  return n
end
local function exhausted()
  return redis.error_reply('ERR turnstile: the numbers of ' .. KEYS[#KEYS] .. ' reached 2^53-1 (its seq field); ' ..
                           'delete the key when nothing holds it')
end

-- Server time: microseconds (fencing tokens) and milliseconds (leases).
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(now_us / 1000)

local fields = {}              -- the hash as loaded: field -> value
local writes, deletes = {}, {} -- what flush() writes back
local function put(field, value) writes[field] = value; deletes[field] = nil; fields[field] = value end
local function drop(field) deletes[field] = true; writes[field] = nil; fields[field] = nil end

local function flush(key)
  local del, set = {}, {}
  for field in pairs(deletes) do del[#del + 1] = field end
  for field, value in pairs(writes) do set[#set + 1] = field; set[#set + 1] = value end
  for i = 1, #del, 1000 do redis.call('HDEL', key, unpack(del, i, math.min(i + 999, #del))) end
  for i = 1, #set, 1000 do redis.call('HSET', key, unpack(set, i, math.min(i + 999, #set))) end
end

-- Requests and at-most-once. A request id is "<client>:<n>", n growing per client; entries
-- store it (their owner). A call that may create or change something sends it marked,
-- "<client>:<n>:<low>": the client has settled every request of its own on this key numbered
-- below <low> (answered, or given up and retired), so a copy of one arriving now is late and
-- changes nothing, however many calls came between. What the client's requests from <low> on
-- did is remembered in 'r:<client>' = "<until ms> L<low> <n>=<result> ...": a resend gets the
-- first answer, and a retired request ('x', or a release or leave) cannot be applied later.
-- Only requests still in flight stay listed (the client raises <low> past the rest), so the
-- record holds no count window. A client may also name the requests below <low> still in
-- flight (its 5th part, "<e1>,<e2>,...": then <low> is past its last request, and everything
-- below it but those is settled), so one long waiter does not pin the watermark and make the
-- record grow with every other request of its client ("E<e1>,<e2>" in the record). One field per client and key, reaped once its "until" passes:
-- `memory_ms` after the client's last request there at least, or longer when the request asks
-- (its 4th part, "<client>:<n>:<low>:<keep ms>": 2 TTLs, see docs/backends/redis.md: how
-- late a copy may come). A rewrite never brings "until" nearer.
-- Every script reads the whole hash, so this is also how many clients' records a busy name
-- carries: 2 minutes (measured: 600 records make an acquire and a release 15 times slower).
local memory_ms = 120000
local function split_request(request) return string.match(request, '^([0-9a-f]+):(%d+)$') end
-- The id, the client and n of a marked request, the client's watermark and how long its record
-- is to be kept (0: not said); nil when malformed.
local function split_marked(marked)
  local client, n, low, keep, open = string.match(marked, '^([0-9a-f]+):(%d+):(%d+):?(%d*):?([%d,]*)$')
  if not client or #n > 15 or #low > 15 or #keep > 15 then return nil end
  return client .. ':' .. n, client, tonumber(n), tonumber(low), tonumber(keep) or 0, open
end
-- The set of numbers in "<e1>,<e2>,...".
local function number_set(text)
  local set = {}
  for e in string.gmatch(text or '', '%d+') do set[tonumber(e)] = true end
  return set
end

local records = {}  -- client -> {low, items (n -> result), until_ms, keep_ms, changed}, as loaded and updated
local function record_of(client)
  local record = records[client]
  if record then return record end
  record = {low = 0, items = {}, until_ms = 0, keep_ms = 0, changed = false}
  local text = fields['r:' .. client] or ''
  record.until_ms = tonumber(string.match(text, '^(%d+) ')) or 0
  record.low = tonumber(string.match(text, '^%d+ L(%d+)')) or 0
  record.open = number_set(string.match(text, '^%d+ L%d+ E([%d,]+)'))  -- below low, in flight
  for n, result in string.gmatch(text, ' (%d+)=(%S+)') do record.items[tonumber(n)] = result end
  records[client] = record
  return record
end

-- What the marked request did before: its result; 'late' when its client had settled it
-- (a copy delivered after its sender went on); nil when it is new. Raises the client's watermark.
local function recalled(marked)
  local _, client, n, low, keep, open = split_marked(marked)
  local record = record_of(client)
  record.keep_ms = math.max(record.keep_ms, keep)
  if low > record.low then
    -- Newer news (a copy that took longer says less, and is not read): what was in flight
    -- then and is not named now has been settled since.
    record.low, record.open = low, number_set(open)
    record.changed = true
    for item in pairs(record.items) do
      if item < low and not record.open[item] then record.items[item] = nil end
    end
  end
  if n < record.low and not record.open[n] then return 'late' end
  return record.items[n]
end

local function remember(marked, result)
  local _, client, n, _, keep = split_marked(marked)
  local record = record_of(client)
  record.keep_ms = math.max(record.keep_ms, keep)
  record.items[n] = result
  record.changed = true
end

-- Writes the records that changed (by put: before the family's flush), each kept for the
-- longest of memory_ms, `keep_ms`, what its requests asked, and what it was kept before.
local function save_records(keep_ms)
  for client, record in pairs(records) do
    if record.changed then
      local until_ms = math.max(record.until_ms, now + math.max(keep_ms or 0, record.keep_ms, memory_ms))
      local numbers, parts = {}, {fmt(until_ms), 'L' .. fmt(record.low)}
      local open = {}
      for e in pairs(record.open) do open[#open + 1] = e end
      table.sort(open)
      for i, e in ipairs(open) do open[i] = fmt(e) end
      if #open > 0 then parts[#parts + 1] = 'E' .. table.concat(open, ',') end
      for n in pairs(record.items) do numbers[#numbers + 1] = n end
      table.sort(numbers)
      for _, n in ipairs(numbers) do parts[#parts + 1] = fmt(n) .. '=' .. record.items[n] end
      put('r:' .. client, table.concat(parts, ' '))
    end
  end
end

-- A request record field: reaped once stale. Returns true when the field was one.
local function load_record(field, value)
  if string.sub(field, 1, 2) ~= 'r:' then return false end
  local until_ms = tonumber(string.match(value, '^(%d+) '))
  if not until_ms or until_ms <= now then drop(field) end
  return true
end

-- The answer to a request that may not be applied (late, or given up by its sender): nothing
-- changed. Its sender never reads it; a live request never gets it.
local function given_up(marked)
  return redis.error_reply('ERR turnstile: request ' .. marked .. ' was settled or given up by its sender; nothing done')
end

-- Reads a family's hash whole: 'seq' (the last number handed out), numbered items (given to
-- `parse(seq, field, value)`, which returns the item, or nil to drop it: expired or unreadable),
-- request records (stale ones reaped), fields `keep` claims, and anything else, which is dropped. Returns the items
-- in order and the largest number seen ('seq' or an item's, whichever is larger). A 'seq' that
-- is no token of ours is ignored (then rewritten): the clock floor of new tokens, and the
-- entries' own numbers, keep tokens growing; a numbered field that is no token is dropped.
-- `keep(field, value)` (optional) claims the family's other fields: true keeps the field as is.
local function load_hash(key, parse, keep)
  local items, last = {}, 0
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do
    local field, value = flat[i], flat[i + 1]
    fields[field] = value
    if field == 'seq' then
      last = math.max(last, token_of(value) or 0)
    elseif token_of(field) then
      local seq = token_of(field)
      last = math.max(last, seq)
      local item = parse(seq, field, value)
      if item then items[#items + 1] = item else drop(field) end
    elseif not load_record(field, value) and not (keep and keep(field, value)) then
      drop(field)
    end
  end
  table.sort(items, function(a, b) return a.seq < b.seq end)
  return items, last
end

-- The hash's field count once flush() has run: `fields` is the hash as loaded whole (HGETALL),
-- with every put and drop since, so this is what HLEN would answer, without asking.
local function field_count()
  local count = 0
  for _ in pairs(fields) do count = count + 1 end
  return count
end

-- Writes 'seq' when it grew, then everything changed (request records kept `keep_ms`, at
-- least memory_ms), in one HSET (and one HDEL when something went). `last_put` (optional)
-- runs just before the write, to put what depends on everything else put.
local function save_hash(key, last, keep_ms, last_put)
  if last > (token_of(fields['seq']) or 0) then put('seq', fmt(last)) end
  save_records(keep_ms)
  if last_put then last_put() end
  flush(key)
end
