-- Renew ONE partition's lease. KEYS: lease. ARGV: instance id, incarnation, epoch, ttl_ms.
-- Returns 1, or 0 when the lease is no longer this holder's (taken over, or released).
local lease_key = KEYS[1]
local owner, inc, epoch, state = unpack(
    redis.call('HMGET', lease_key, 'owner', 'inc', 'epoch', 'state'))
if owner ~= ARGV[1] or inc ~= ARGV[2] or epoch ~= ARGV[3] or state == 'released' then
    return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', lease_key, 'expires', now + tonumber(ARGV[4]))
return 1
