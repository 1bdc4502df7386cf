-- reset_pushed for ONE topic-partition: pushed := persisted (Pulsar's
-- resetHighestSequenceIdPushed), after a write that definitely failed has settled; the
-- chunked messages in progress with them.
--
-- KEYS: pushed, persisted, token, pushed_chunk, persisted_chunk
-- ARGV: token ("" = any)
-- Returns 1, or 0 without changing anything when the token does not match (state lost).
if not token_matches(KEYS[3], ARGV[1]) then
    return 0
end
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('COPY', KEYS[2], KEYS[1])
redis.call('COPY', KEYS[5], KEYS[4])
return 1
