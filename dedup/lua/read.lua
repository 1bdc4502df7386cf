-- A consistent read of keys of ONE slot (dedup/state.py `producers`, `recovered_state`): a
-- script rather than a MULTI pipeline, which a cluster client may not run.
-- KEYS: the keys to read. ARGV[i] says how to read KEYS[i]: "get", "hash" (HGETALL) or
-- "zset" (ZRANGE WITHSCORES). Returns one reply per key, in order.
local out = {}
for i, key in ipairs(KEYS) do
    if ARGV[i] == 'get' then
        out[i] = redis.call('GET', key)
    elseif ARGV[i] == 'hash' then
        out[i] = redis.call('HGETALL', key)
    else
        out[i] = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    end
end
return out
