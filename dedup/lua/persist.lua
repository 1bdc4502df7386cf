-- mark_persisted for ONE topic-partition: Kafka acknowledged these positions.
--
-- KEYS: pushed, persisted, seen, token, pushed_chunk, persisted_chunk
-- ARGV: now_ms, token, then for each producer its highest acknowledged position: producer,
--       sequence, chunk id ("" when the sequence is complete: a whole record or a last
--       chunk), chunk count, total size, size so far, uuid
-- Returns 1, or 0 without changing anything when the token does not match (state lost:
-- the recovery that follows reads these positions back from the log).
-- persisted = max(persisted, position): a complete sequence raises persisted[p] (and ends
-- the message in progress), a chunk that is not the last only persisted_chunk[p], so the
-- sequence counts as persisted once its last chunk is. Then pushed is raised to persisted
-- where it is below (an ack may arrive after a reset_pushed or an eviction).
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local pushed_chunk_key, persisted_chunk_key = KEYS[5], KEYS[6]
local now = ARGV[1]
if not token_matches(KEYS[4], ARGV[2]) then
    return 0
end

for i = 3, #ARGV, 7 do
    local p, s, c_text = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    local seq = redis.call('HGET', persisted_key, p)
    local chunk = redis.call('HGET', persisted_chunk_key, p)
    local c = c_text == '' and LAST or tonumber(c_text)
    if pos_cmp(s, c, seq, chunk) > 0 then
        if c == LAST then
            seq, chunk = s, false
            redis.call('HSET', persisted_key, p, s)
            redis.call('HDEL', persisted_chunk_key, p)
        else
            chunk = chunk_encode(s, c, tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
                tonumber(ARGV[i + 5]), ARGV[i + 6])
            redis.call('HSET', persisted_chunk_key, p, chunk)
        end
    end
    local cur = redis.call('HGET', pushed_key, p)
    local cur_chunk = redis.call('HGET', pushed_chunk_key, p)
    local top_s, top_c -- persisted's position, now at least (s, c)
    if chunk then
        local decoded = chunk_decode(chunk)
        top_s, top_c = decoded.s, decoded.c
    else
        top_s, top_c = seq, LAST
    end
    if pos_cmp(top_s, top_c, cur, cur_chunk) > 0 then
        if seq and (not cur or seq_cmp(seq, cur) > 0) then
            redis.call('HSET', pushed_key, p, seq)
        end
        if chunk then
            redis.call('HSET', pushed_chunk_key, p, chunk)
        else
            redis.call('HDEL', pushed_chunk_key, p)
        end
    end
    redis.call('ZADD', seen_key, 'GT', now, p)
end
return 1
