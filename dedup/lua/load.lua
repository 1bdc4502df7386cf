-- load for ONE topic-partition (recovery): both maps become the recovered persisted map
-- (pushed = persisted), the chunked messages in progress likewise, and the partition gets
-- the recovering proxy's token. A producer's last-seen time is the latest of the one given
-- and the one Redis knows ("" given: the known one, else now); producers missing from the
-- map are forgotten.
--
-- KEYS: pushed, persisted, seen, token, pushed_chunk, persisted_chunk, lease
-- ARGV: now_ms, token ("" = remove the token), the lease that must hold the partition
--       ("owner incarnation epoch"; "" = none is checked), then per producer: producer,
--       sequence ("" = no complete sequence yet), seen_ms, chunk in progress (encoded as in
--       seq.lua, "" = none)
-- Returns 1, or 0 without changing anything when the lease is no longer the caller's (an
-- instance that lost the partition while it replayed must not load its view). Loading
-- opens the lease: its holder may write from now on, and the instances it fenced are no
-- longer suspects.
local pushed_key, persisted_key, seen_key, token_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease_key = KEYS[7]
local now = tonumber(ARGV[1])
if ARGV[3] ~= '' then
    local owner, inc, epoch, state = unpack(
        redis.call('HMGET', lease_key, 'owner', 'inc', 'epoch', 'state'))
    if (owner or '') .. ' ' .. (inc or '') .. ' ' .. (epoch or '') ~= ARGV[3]
        or state == 'released' then
        return 0
    end
    redis.call('HSET', lease_key, 'state', 'open', 'suspects', '')
end

local seen = {}
for i = 4, #ARGV, 4 do
    local p, given = ARGV[i], tonumber(ARGV[i + 2])
    local known = tonumber(redis.call('ZSCORE', seen_key, p))
    if given and known then
        seen[p] = math.max(given, known)
    else
        seen[p] = given or known or now
    end
end
redis.call('DEL', pushed_key, persisted_key, seen_key, token_key, KEYS[5], KEYS[6])
for i = 4, #ARGV, 4 do
    local p, s, chunk = ARGV[i], ARGV[i + 1], ARGV[i + 3]
    if s ~= '' then
        redis.call('HSET', pushed_key, p, s)
        redis.call('HSET', persisted_key, p, s)
    end
    if chunk ~= '' then
        redis.call('HSET', KEYS[5], p, chunk)
        redis.call('HSET', KEYS[6], p, chunk)
    end
    redis.call('ZADD', seen_key, seen[p], p)
end
if ARGV[2] ~= '' then
    redis.call('SET', token_key, ARGV[2] .. ' 0') -- no call counted yet (seq.lua)
end
return 1
