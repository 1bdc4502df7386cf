-- Give up ONE partition's lease. KEYS: token, lease. ARGV: instance id, incarnation, epoch,
-- clean ("1": every write of this holder is settled and snapshotted, so the next owner
-- needs no fence; "0": it may have writes in flight, so it stays a suspect).
-- Returns 1, or 0 when the lease was no longer this holder's. Either way the token goes:
-- nothing this holder sends after its release changes the state.
local token_key, lease_key = KEYS[1], KEYS[2]
local owner, inc, epoch, state = unpack(
    redis.call('HMGET', lease_key, 'owner', 'inc', 'epoch', 'state'))
if owner ~= ARGV[1] or inc ~= ARGV[2] or epoch ~= ARGV[3] then
    return 0
end
redis.call('DEL', token_key)
if ARGV[4] == '1' and state == 'open' then
    redis.call('HSET', lease_key, 'state', 'released', 'expires', 0)
else
    redis.call('HSET', lease_key, 'expires', 0) -- an "open" holder stays a suspect
end
return 1
