-- mark_persisted for ONE topic-partition: Kafka acknowledged these sequences.
--
-- KEYS: pushed, persisted, seen, token
-- ARGV: now_ms, token, then producer, highest acknowledged sequence for each producer
-- Returns 1, or 0 without changing anything when the token does not match (state lost:
-- the recovery that follows reads these sequences back from the log).
-- persisted[p] = max(persisted[p], s); pushed[p] = max(pushed[p], persisted[p]) so that pushed
-- is never below persisted (an ack may arrive after a reset_pushed or an eviction).
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local now = ARGV[1]
if not token_matches(KEYS[4], ARGV[2]) then
    return 0
end

for i = 3, #ARGV, 2 do
    local p, s = ARGV[i], ARGV[i + 1]
    local old = redis.call('HGET', persisted_key, p)
    if old and seq_cmp(s, old) <= 0 then
        s = old
    else
        redis.call('HSET', persisted_key, p, s)
    end
    local cur = redis.call('HGET', pushed_key, p)
    if not cur or seq_cmp(s, cur) > 0 then
        redis.call('HSET', pushed_key, p, s)
    end
    redis.call('ZADD', seen_key, 'GT', now, p)
end
return 1
