-- reset_pushed for ONE topic-partition: pushed := persisted (Pulsar's
-- resetHighestSequenceIdPushed), after a write that definitely failed has settled.
--
-- KEYS: pushed, persisted
redis.call('DEL', KEYS[1])
redis.call('COPY', KEYS[2], KEYS[1])
return 0
