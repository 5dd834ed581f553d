-- The queue as `turnstile inspect` shows it: {{seq, entry}...} in order.
load()
admit(nil)
save()
local result = {}
for _, e in ipairs(entries) do result[#result + 1] = {e.seq, entry_text(e)} end
return result
