-- SPDX-License-Identifier: Apache-2.0
-- The PermitCounter scripts. Redisson's RSemaphore layout, so Java and C++ share the permits:
-- KEYS[1] is the name itself, a plain string holding the count, and releases are published on
-- ARGV[1] (Redisson's channel for the name). turnstile's FIFO of waiters lives beside it, in
-- the same cluster slot, in ONE hash KEYS[2]:
--   'seq'        the last place in line handed out
--   '<seq>'      a waiter: "<until ms> <request> <pid> <host> <since ms>[ <label>]"
--   'r:<client>' what the client's requests in flight did (see common_prelude: at most once)
-- Redisson's own waiters do not queue there: they may overtake turnstile's.
local permits_key, line_key, channel = KEYS[1], KEYS[2], ARGV[1]
local waiters, last, reaped = {}, 0, false

local function load()
  waiters, last = load_hash(line_key, function(seq, field, value)
    local expiry, request, who = string.match(value, '^(%d+) (%S+) (.*)$')
    if expiry and tonumber(expiry) > now then
      return {seq = seq, field = field, expiry = tonumber(expiry), request = request, who = who}
    end
    reaped = true  -- stopped renewing (dead, or paused past its lease), or unreadable
  end)
end

local function save() save_hash(line_key, last) end

-- Loads the line; returns what the marked request did if it ran before (a resend), 'late' when
-- its client had settled it, nil when it is new (see common_prelude).
local function load_or_recall(marked)
  if not split_marked(marked) then return nil, redis.error_reply('ERR turnstile counter: bad request id') end
  load()
  return recalled(marked)
end

-- The count; a value that is not an integer (written by hand) counts as none available.
local function available()
  local value = redis.call('GET', permits_key)
  return value and tonumber(string.match(value, '^%-?%d+$') and value) or 0
end

local function remove_waiter(i)
  drop(waiters[i].field)
  table.remove(waiters, i)
end

-- The waiter now first in line looks again (every waiter listens; a client wakes its waiter
-- that is first in line, see redis_backend.cpp).
local function nudge()
  local value = available()
  if value > 0 and #waiters > 0 then redis.call('PUBLISH', channel, fmt(value)) end
end
