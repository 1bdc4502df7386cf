-- Membership of the proxy instances sharing this Redis: join, heartbeat, leave.
--
-- KEYS: info (hash id -> "incarnation slot json"), alive (zset id -> expiry ms, Redis time),
--       slots (hash id -> slot number), next_slot (counter)
-- ARGV: mode ("join", "beat" or "leave"), id, incarnation, ttl_ms, info json
-- Returns { "taken", incarnation, ms left } when another live process holds the id (a
-- configuration error: two instances with one id would fence each other), else
-- { "ok", slot, then id, "incarnation slot json" for every live member }.
-- Expiry is in Redis's clock, so instances' clocks need not agree. A member's slot is
-- kept for good: the node ids clients see for it (dedup/ownership/nodes.py) never change.
local info_key, alive_key, slots_key, next_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local mode, id, inc, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local current = redis.call('HGET', info_key, id)
local expires = tonumber(redis.call('ZSCORE', alive_key, id) or '0')
local current_inc = current and string.match(current, '^(%S+)') or nil
if current_inc and current_inc ~= inc and expires > now then
    return { 'taken', current_inc, tostring(expires - now) }
end
if mode == 'leave' then
    if current_inc == inc then
        redis.call('ZREM', alive_key, id)
    end
    return { 'ok', '0' }
end

local slot = redis.call('HGET', slots_key, id)
if not slot then
    slot = tostring(redis.call('INCR', next_key))
    redis.call('HSET', slots_key, id, slot)
end
redis.call('HSET', info_key, id, inc .. ' ' .. slot .. ' ' .. ARGV[5])
redis.call('ZADD', alive_key, now + ttl, id)
-- Forget members dead for long; their slots stay reserved.
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', alive_key, '-inf', now - 100 * ttl)) do
    redis.call('ZREM', alive_key, gone)
    redis.call('HDEL', info_key, gone)
end

local result = { 'ok', slot }
for _, member in ipairs(redis.call('ZRANGEBYSCORE', alive_key, now, '+inf')) do
    result[#result + 1] = member
    result[#result + 1] = redis.call('HGET', info_key, member) or ''
end
return result
