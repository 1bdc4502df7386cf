-- load for ONE topic-partition (recovery): both maps become the recovered persisted map
-- (pushed = persisted) and the partition gets the recovering proxy's token. A producer's
-- last-seen time is the latest of the one given and the one Redis knows ("" given: the
-- known one, else now); producers missing from the map are forgotten.
--
-- KEYS: pushed, persisted, seen, token
-- ARGV: now_ms, token ("" = remove the token), then producer, sequence, seen_ms per producer
local pushed_key, persisted_key, seen_key, token_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])

local seen = {}
for i = 3, #ARGV, 3 do
    local p, given = ARGV[i], tonumber(ARGV[i + 2])
    local known = tonumber(redis.call('ZSCORE', seen_key, p))
    if given and known then
        seen[p] = math.max(given, known)
    else
        seen[p] = given or known or now
    end
end
redis.call('DEL', pushed_key, persisted_key, seen_key, token_key)
for i = 3, #ARGV, 3 do
    local p, s = ARGV[i], ARGV[i + 1]
    redis.call('HSET', pushed_key, p, s)
    redis.call('HSET', persisted_key, p, s)
    redis.call('ZADD', seen_key, seen[p], p)
end
if ARGV[2] ~= '' then
    redis.call('SET', token_key, ARGV[2])
end
return 0
