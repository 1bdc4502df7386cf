-- check_and_push for ONE topic-partition: classify every record of a batch, then either write
-- nothing (some record is Unknown or bad: the batch is refused) or raise pushed[p] and
-- last-seen.
--
-- KEYS: pushed (hash), persisted (hash), seen (zset producer -> last seen ms), token (string),
--       pushed_chunk (hash), persisted_chunk (hash): the chunked message in progress
-- ARGV: now_ms, max_producers, token, stride (2 or 7), then for every record in batch order:
--       producer, sequence, and with stride 7: chunk id ("" for a record that is not a
--       chunk), chunk count, total size, value size, uuid. A batch without chunks (the
--       common case) is sent with stride 2, which keeps the plain check as cheap as before.
-- Returns { statuses, sizes, evicted producer... }; statuses holds one digit per record:
-- "0" NotDup, "1" Dup, "2" Unknown; sizes (stride 7 only, else empty) one entry per record:
-- the bytes of its message so far for a NotDup chunk that is not the last, else "". Returns { "lost" } and changes
-- nothing when a token is given and the partition's token differs: its state was lost or
-- replaced since the caller recovered it, so no answer from it can be trusted. Returns
-- { "bad", record number (1-based), message } and changes nothing when a chunk breaks the
-- chunk rule (dedup/chunks.py `accept_chunk`, whose messages these are word for word), or
-- { "gap", ... } alike when the chunk skips ahead: an earlier chunk may still be on its way
-- (a pipelined request refused while the partition recovered, or being retried).
--
-- The check is on positions (sequence, chunk id), not on sequences: pushed[p] and
-- persisted[p] stay at the last COMPLETE sequence, and a message in progress sits beside
-- them in pushed_chunk[p] / persisted_chunk[p] (its sequence above theirs).
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local pushed_chunk_key, persisted_chunk_key = KEYS[5], KEYS[6]
local now, max_producers = ARGV[1], tonumber(ARGV[2])
if not token_matches(KEYS[4], ARGV[3]) then
    return { 'lost' }
end

local before = {}          -- producer -> pushed[p] when the batch started (false: none)
local before_chunk = {}    -- producer -> pushed_chunk[p] then (false: none)
local pushed = {}          -- producer -> pushed[p] as raised by this batch so far
local chunk = {}           -- producer -> pushed_chunk[p] as this batch left it
local persisted = {}       -- producer -> persisted[p] (false: none), read when first needed
local persisted_chunk = {} -- producer -> persisted_chunk[p] (false: none)
local producers = {}       -- producers in order of first appearance
local statuses, sizes = {}, {}
local refused = false

local function where(c, u, s)
    return 'chunk ' .. c .. ' of message ' .. u .. ' (sequence ' .. s .. ')'
end

local n = 0
local stride = tonumber(ARGV[4])
for i = 5, #ARGV, stride do
    n = n + 1
    local p, s = ARGV[i], ARGV[i + 1]
    local c_text = stride == 7 and ARGV[i + 2] or ''
    if before[p] == nil then
        before[p] = redis.call('HGET', pushed_key, p)
        before_chunk[p] = redis.call('HGET', pushed_chunk_key, p)
        pushed[p], chunk[p] = before[p], before_chunk[p]
        producers[#producers + 1] = p
    end
    local cur = chunk[p] and chunk_decode(chunk[p]) or nil
    local same = cur and seq_cmp(cur.s, s) == 0
    local c, count, total, size, u = LAST, nil, nil, nil, nil
    if c_text ~= '' then
        c, count = tonumber(c_text), tonumber(ARGV[i + 3])
        total, size, u = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5]), ARGV[i + 6]
        if c == count - 1 then
            c = LAST -- the last chunk completes the sequence
        end
        if same and (u ~= cur.u or count ~= cur.n or total ~= cur.t) then
            return { 'bad', n, where(c_text, u, s) .. ' says uuid ' .. u .. ', ' .. ARGV[i + 3]
                .. ' chunks, ' .. ARGV[i + 4] .. ' bytes, but its chunks so far say uuid '
                .. cur.u .. ', ' .. cur.n .. ' chunks, ' .. string.format('%d', cur.t)
                .. ' bytes' }
        end
    end
    local status, size_out = nil, ''
    if pos_cmp(s, c, pushed[p], chunk[p]) > 0 then
        status = '0' -- NotDup: new; later records of this batch see the raised position
        if c_text == '' then
            if same then
                return { 'bad', n, 'a record without chunk headers has sequence ' .. s
                    .. ', which is the chunked message ' .. cur.u .. ' in progress (chunk '
                    .. cur.c .. ' of ' .. cur.n .. ' accepted)' }
            end
            pushed[p], chunk[p] = s, false -- a message in progress is abandoned
        else
            local so_far = 0
            if same then
                if tonumber(c_text) ~= cur.c + 1 then
                    return { 'gap', n, where(c_text, u, s) .. ' skips ahead: the next chunk is '
                        .. (cur.c + 1) }
                end
                so_far = cur.z
            elseif c_text ~= '0' then
                return { 'gap', n, where(c_text, u, s)
                    .. " skips ahead: the message's chunk 0 was never accepted" }
            end
            so_far = so_far + size
            if so_far > total then
                return { 'bad', n, where(c_text, u, s) .. ' brings the message to '
                    .. string.format('%d', so_far) .. ' bytes, over its total size '
                    .. ARGV[i + 4] }
            end
            if c == LAST then
                if so_far ~= total then
                    return { 'bad', n, where(c_text, u, s) .. ' is the last, but the chunks add up to '
                        .. string.format('%d', so_far) .. ' bytes, not the total size '
                        .. ARGV[i + 4] }
                end
                pushed[p], chunk[p] = s, false
            else
                chunk[p] = chunk_encode(s, c, count, total, so_far, u)
                size_out = string.format('%d', so_far)
            end
        end
    else
        if persisted[p] == nil then
            persisted[p] = redis.call('HGET', persisted_key, p)
            persisted_chunk[p] = redis.call('HGET', persisted_chunk_key, p)
        end
        if pos_cmp(s, c, persisted[p], persisted_chunk[p]) <= 0 then
            status = '1' -- Dup: Kafka acknowledged it
        elseif pos_cmp(s, c, before[p], before_chunk[p]) > 0 then
            status = '1' -- Dup: an earlier record of this batch, written together with this one
        else
            status = '2' -- Unknown: pushed by an earlier batch, not acknowledged (yet?)
            refused = true
        end
    end
    statuses[#statuses + 1] = status
    if stride == 7 then
        sizes[#sizes + 1] = size_out
    end
end

local result = { table.concat(statuses), sizes }
if refused then
    return result -- nothing changed: the whole partition batch is retried later
end

for _, p in ipairs(producers) do
    if pushed[p] ~= before[p] then
        redis.call('HSET', pushed_key, p, pushed[p])
    end
    if chunk[p] ~= before_chunk[p] then
        if chunk[p] then
            redis.call('HSET', pushed_chunk_key, p, chunk[p])
        else
            redis.call('HDEL', pushed_chunk_key, p)
        end
    end
    redis.call('ZADD', seen_key, 'GT', now, p) -- GT: a proxy with a slow clock never moves it back
end

-- Over max_producers: evict the least recently seen producers, never one of this batch.
local excess = redis.call('ZCARD', seen_key) - max_producers
if excess > 0 then
    for _, p in ipairs(redis.call('ZRANGE', seen_key, 0, excess + #producers - 1)) do
        if excess == 0 then
            break
        end
        if before[p] == nil then
            redis.call('HDEL', pushed_key, p)
            redis.call('HDEL', persisted_key, p)
            redis.call('HDEL', pushed_chunk_key, p)
            redis.call('HDEL', persisted_chunk_key, p)
            redis.call('ZREM', seen_key, p)
            result[#result + 1] = p
            excess = excess - 1
        end
    end
end
return result
