-- Take the ownership lease of ONE topic-partition.
--
-- KEYS: pushed, persisted, seen, token, pushed_chunk, persisted_chunk, lease (hash: owner,
--       inc, epoch, expires, state, suspects)
-- ARGV: instance id, incarnation, ttl_ms
-- Returns
--   { "mine", epoch, state, suspects } when this incarnation holds it already (renewed);
--   { "held", owner, ms left } when another instance holds a live lease;
--   { "granted", epoch, suspects, has_state }: the lease is this incarnation's
--   with a new epoch. The partition's token is removed, so every script call of an older
--   owner now answers "lost": a stale owner can change nothing from here on.
-- state: "fresh" (taken, not yet recovered: its holder wrote nothing), "open" (recovered and
-- serving: its holder may have writes in flight), "released" (handed over: its writes
-- settled and snapshotted). suspects: the instances whose writes may still land in the
-- partition (an "open" holder that did not release, and the suspects no owner fenced
-- yet): the new owner fences each of them on Kafka before it replays (dedup/recovery.py).
-- A partition that never had an owner gets the suspect "?": unknown, the new owner decides
-- from the log whether anything needs fencing. Suspects are kept until the lease opens, so
-- a holder that takes the lease again before it opened (a failed fence) sees them all.
local lease_key, token_key = KEYS[7], KEYS[4]
local me, inc, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local owner, owner_inc, epoch, expires, state, suspects = unpack(
    redis.call('HMGET', lease_key, 'owner', 'inc', 'epoch', 'expires', 'state', 'suspects'))
if owner then
    if owner == me and owner_inc == inc and state ~= 'released' then
        redis.call('HSET', lease_key, 'expires', now + ttl)
        return { 'mine', epoch, state, suspects or '' }
    end
    -- One this incarnation released is taken anew below (a new epoch, its token gone): a
    -- released lease may be taken by any instance at once, so holding it "as mine" again
    -- would let two write.
    -- The id is unique among live processes (membership), so a lease of this id from
    -- another incarnation is a dead predecessor's: taken over at once (and fenced).
    if owner ~= me and state ~= 'released' and tonumber(expires) > now then
        return { 'held', owner, tostring(tonumber(expires) - now) }
    end
end

local list = {}
local seen = {}
for s in string.gmatch(suspects or '', '%S+') do
    if not seen[s] then
        list[#list + 1], seen[s] = s, true
    end
end
if owner and state == 'open' and not seen[owner] then
    list[#list + 1] = owner
end
if not owner and not seen['?'] then
    list[#list + 1] = '?'
end
suspects = table.concat(list, ' ')
epoch = redis.call('HINCRBY', lease_key, 'epoch', 1)
redis.call('HSET', lease_key, 'owner', me, 'inc', inc, 'expires', now + ttl, 'state', 'fresh',
    'suspects', suspects)
redis.call('DEL', token_key)
local has_state = redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[5], KEYS[6]) > 0
return { 'granted', tostring(epoch), suspects, has_state and '1' or '0' }
