-- check_and_push for ONE topic-partition: classify every record of a batch, then either write
-- nothing (some record is Unknown: the batch is refused) or raise pushed[p] and last-seen.
--
-- KEYS: pushed (hash), persisted (hash), seen (zset producer -> last seen ms), token (string)
-- ARGV: now_ms, max_producers, token, then producer, sequence for every record in batch order
-- Returns { statuses, evicted producer... }; statuses holds one digit per record:
-- "0" NotDup, "1" Dup, "2" Unknown. Returns { "lost" } and changes nothing when a token is
-- given and the partition's token differs: its state was lost or replaced since the caller
-- recovered it, so no answer from it can be trusted.
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local now, max_producers = ARGV[1], tonumber(ARGV[2])
if not token_matches(KEYS[4], ARGV[3]) then
    return { 'lost' }
end

local before = {}    -- producer -> pushed[p] when the batch started (false: none)
local pushed = {}    -- producer -> pushed[p] as raised by this batch so far (false: none)
local persisted = {} -- producer -> persisted[p] (false: none), read when first needed
local producers = {} -- producers in order of first appearance
local statuses = {}
local refused = false

for i = 4, #ARGV, 2 do
    local p, s = ARGV[i], ARGV[i + 1]
    if before[p] == nil then
        before[p] = redis.call('HGET', pushed_key, p)
        pushed[p] = before[p]
        producers[#producers + 1] = p
    end
    local status
    if not pushed[p] or seq_cmp(s, pushed[p]) > 0 then
        status = '0' -- NotDup: new; later records of this batch see the raised value
        pushed[p] = s
    else
        if persisted[p] == nil then
            persisted[p] = redis.call('HGET', persisted_key, p)
        end
        if persisted[p] and seq_cmp(s, persisted[p]) <= 0 then
            status = '1' -- Dup: Kafka acknowledged it
        elseif not before[p] or seq_cmp(s, before[p]) > 0 then
            status = '1' -- Dup: an earlier record of this batch, written together with this one
        else
            status = '2' -- Unknown: pushed by an earlier batch, not acknowledged (yet?)
            refused = true
        end
    end
    statuses[#statuses + 1] = status
end

local result = { table.concat(statuses) }
if refused then
    return result -- nothing changed: the whole partition batch is retried later
end

for _, p in ipairs(producers) do
    if pushed[p] ~= before[p] then
        redis.call('HSET', pushed_key, p, pushed[p])
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
            redis.call('ZREM', seen_key, p)
            result[#result + 1] = p
            excess = excess - 1
        end
    end
end
return result
