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

-- Request ids are "<client>:<n>". What a request did is remembered (field 'r:<client>',
-- "<until ms> <n>=<result> ..." for its 16 latest requests) so a resend after a lost reply
-- gets the first answer instead of doing it twice. One field per client, reaped once stale.
local function split_request(request) return string.match(request, '^(.+):(%d+)$') end

local function recalled(request)
  local client, n = split_request(request)
  local record = client and fields['r:' .. client]
  if not record then return nil end
  return string.match(record .. ' ', ' ' .. n .. '=(%S+) ')
end

local function remember(request, result, keep_ms)
  local client, n = split_request(request)
  if not client then return end
  local items = {}
  for item in string.gmatch(fields['r:' .. client] or '', '%d+=%S+') do items[#items + 1] = item end
  items[#items + 1] = n .. '=' .. result
  while #items > 16 do table.remove(items, 1) end
  put('r:' .. client, fmt(now + keep_ms) .. ' ' .. table.concat(items, ' '))
end

-- A request record field: reaped once stale. Returns true when the field was one.
local function load_record(field, value)
  if string.sub(field, 1, 2) ~= 'r:' then return false end
  local until_ms = tonumber(string.match(value, '^(%d+) '))
  if not until_ms or until_ms <= now then drop(field) end
  return true
end

-- Reads a family's hash whole: 'seq' (the last number handed out), numbered items (given to
-- `parse(seq, field, value)`, which returns the item, or nil to drop it: expired or unreadable),
-- request records (stale ones reaped), and anything else, which is dropped. Returns the items
-- in order and the largest number seen ('seq' or an item's, whichever is larger). A 'seq' that
-- is no token of ours is ignored (then rewritten): the clock floor of new tokens, and the
-- entries' own numbers, keep tokens growing; a numbered field that is no token is dropped.
local function load_hash(key, parse)
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
    elseif not load_record(field, value) then
      drop(field)
    end
  end
  table.sort(items, function(a, b) return a.seq < b.seq end)
  return items, last
end

-- Writes 'seq' when it grew, then everything changed.
local function save_hash(key, last)
  if last > (token_of(fields['seq']) or 0) then put('seq', fmt(last)) end
  flush(key)
end
