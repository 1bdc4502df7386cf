-- load_persisted for ONE topic-partition (recovery): both maps become the recovered persisted
-- map (pushed = persisted). Producers already known keep their last-seen time, new ones get now;
-- producers missing from the map are forgotten.
--
-- KEYS: pushed, persisted, seen
-- ARGV: now_ms, then producer, sequence for each producer
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local now = ARGV[1]

local seen = {}
for i = 2, #ARGV, 2 do
    local p = ARGV[i]
    seen[p] = redis.call('ZSCORE', seen_key, p) or now
end
redis.call('DEL', pushed_key, persisted_key, seen_key)
for i = 2, #ARGV, 2 do
    local p, s = ARGV[i], ARGV[i + 1]
    redis.call('HSET', pushed_key, p, s)
    redis.call('HSET', persisted_key, p, s)
    redis.call('ZADD', seen_key, seen[p], p)
end
return 0
