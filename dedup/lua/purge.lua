-- purge_idle for ONE topic-partition: forget producers last seen before a time.
--
-- KEYS: pushed, persisted, seen, token (unused), pushed_chunk, persisted_chunk
-- ARGV: older_than_ms (producers with last seen < older_than_ms go)
-- Returns the purged producers.
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local idle = redis.call('ZRANGEBYSCORE', seen_key, '-inf', '(' .. ARGV[1])
for _, p in ipairs(idle) do
    redis.call('HDEL', pushed_key, p)
    redis.call('HDEL', persisted_key, p)
    redis.call('HDEL', KEYS[5], p)
    redis.call('HDEL', KEYS[6], p)
    redis.call('ZREM', seen_key, p)
end
return idle
