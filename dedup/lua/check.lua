-- check_and_push for ONE topic-partition: classify every record of a batch, then either write
-- nothing (some record is Unknown or bad: the batch is refused) or raise pushed[p] and
-- last-seen.
--
-- KEYS: pushed (hash), persisted (hash), seen (zset producer -> last seen ms), token (string),
--       pushed_chunk (hash), persisted_chunk (hash): the chunked message in progress
-- ARGV: now_ms, max_producers, max_jump (0: none), token, stride (2, 4 or 7), then in batch
--       order:
--       stride 2 and 7, for every record: producer, sequence, and with stride 7: chunk id
--       ("" for a record that is not a chunk), chunk count, total size, value size, uuid.
--       A batch without chunks (the common case) is sent with stride 2 or 4, which keep the
--       plain check as cheap as before chunks.
--       stride 4, for every run (consecutive records of one producer whose sequences rise by
--       exactly 1; no chunks): producer, first sequence, last sequence, count of records.
--       A run whose first position is above pushed[p] is NotDup all through with one
--       comparison. A run that overlaps it gets one status all through when its ends tell
--       (acknowledged; pushed by an earlier batch and not acknowledged; raised by this
--       batch), else it is checked record by record as with stride 2, up to its first
--       NotDup record (the rest is above it). That needs each record's sequence, which a
--       Lua number holds exactly only below 2^53: when the run's first or last is not below
--       10^15 in magnitude the script answers { "expand" } and changes nothing (its call is
--       not counted either), and the caller re-sends the batch with stride 2.
-- Returns { statuses, sizes, evicted producer... }; statuses holds one digit per record:
-- "0" NotDup, "1" Dup, "2" Unknown; sizes (stride 7 only, else empty) one entry per record:
-- the bytes of its message so far for a NotDup chunk that is not the last, else "". Returns { "lost" } and changes
-- nothing when a token is given and the partition's token differs: its state was lost or
-- replaced since the caller recovered it, so no answer from it can be trusted. Returns
-- { "bad", record number (1-based), message } and changes nothing when a chunk breaks the
-- chunk rule (dedup/chunks.py `accept_chunk`, whose messages these are word for word), or
-- { "jump", record number, message } alike when a record is more than max_jump above its
-- producer's pushed[p] (a known producer only: a new one may start anywhere), or
-- { "gap", ... } alike when the chunk skips ahead: an earlier chunk may still be on its way
-- (a pipelined request refused while the partition recovered, or being retried).
--
-- The check is on positions (sequence, chunk id), not on sequences: pushed[p] and
-- persisted[p] stay at the last COMPLETE sequence, and a message in progress sits beside
-- them in pushed_chunk[p] / persisted_chunk[p] (its sequence above theirs).
local pushed_key, persisted_key, seen_key = KEYS[1], KEYS[2], KEYS[3]
local pushed_chunk_key, persisted_chunk_key = KEYS[5], KEYS[6]
local now, max_producers, max_jump = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local guard, stride = ARGV[4], tonumber(ARGV[5])
if not token_holds(KEYS[4], guard) then
    return { 'lost' }
end

local before = {}          -- producer -> pushed[p] when the batch started (false: none)
local before_chunk = {}    -- producer -> pushed_chunk[p] then (false: none)
local pushed = {}          -- producer -> pushed[p] as raised by this batch so far
local chunk = {}           -- producer -> pushed_chunk[p] as this batch left it
local persisted = {}       -- producer -> persisted[p] (false: none), read when first needed
local persisted_chunk = {} -- producer -> persisted_chunk[p] (false: none)
local producers = {}       -- producers in order of first appearance
local statuses, sizes = {}, {}
local refused = false
local EXPAND = { 'expand' }

local function where(c, u, s)
    return 'chunk ' .. c .. ' of message ' .. u .. ' (sequence ' .. s .. ')'
end

-- meet(p): reads the producer's state at its first record of the batch.
local function meet(p)
    if before[p] == nil then
        before[p] = redis.call('HGET', pushed_key, p)
        before_chunk[p] = redis.call('HGET', pushed_chunk_key, p)
        pushed[p], chunk[p] = before[p], before_chunk[p]
        producers[#producers + 1] = p
    end
end

-- meet_persisted(p): reads the producer's persisted position when first needed.
local function meet_persisted(p)
    if persisted[p] == nil then
        persisted[p] = redis.call('HGET', persisted_key, p)
        persisted_chunk[p] = redis.call('HGET', persisted_chunk_key, p)
    end
end

-- record(n, p, s, i): classifies record number n (producer p, sequence s); i is its index
-- in ARGV with stride 7 (its chunk fields follow), else nil. Returns a reply that ends the
-- script ('bad', 'gap'), else nil.
local function record(n, p, s, i)
    if before[p] == nil then -- inline test: this runs for every record with stride 2 and 7
        meet(p)
    end
    local c_text = i and ARGV[i + 2] or ''
    local cur = chunk[p] and chunk_decode(chunk[p]) or nil
    local same = cur and seq_cmp(cur.s, s) == 0
    local c, count, total, size, u = LAST, nil, nil, nil, nil
    if c_text ~= '' then
        c, count = tonumber(c_text), tonumber(ARGV[i + 3])
        total, size, u = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5]), ARGV[i + 6]
        if c == count - 1 then
            c = LAST -- the last chunk completes the sequence
        end
        if same and (u ~= cur.u or count ~= cur.n or total ~= cur.t) then
            return { 'bad', n, where(c_text, u, s) .. ' says uuid ' .. u .. ', ' .. ARGV[i + 3]
                .. ' chunks, ' .. ARGV[i + 4] .. ' bytes, but its chunks so far say uuid '
                .. cur.u .. ', ' .. cur.n .. ' chunks, ' .. string.format('%d', cur.t)
                .. ' bytes' }
        end
    end
    local status, size_out = nil, ''
    if pos_cmp(s, c, pushed[p], chunk[p]) > 0 then
        if max_jump > 0 and pushed[p] and tonumber(s) - tonumber(pushed[p]) > max_jump then
            -- Lua numbers: exact below 2^53, within a few thousand beyond (a coarse bound).
            return { 'jump', n, 'sequence ' .. s .. ' is more than ' .. ARGV[3]
                .. ' above ' .. p .. "'s last sequence " .. pushed[p]
                .. ' (max_sequence_jump): refused, nothing written' }
        end
        status = '0' -- NotDup: new; later records of this batch see the raised position
        if c_text == '' then
            if same then
                return { 'bad', n, 'a record without chunk headers has sequence ' .. s
                    .. ', which is the chunked message ' .. cur.u .. ' in progress (chunk '
                    .. cur.c .. ' of ' .. cur.n .. ' accepted)' }
            end
            pushed[p], chunk[p] = s, false -- a message in progress is abandoned
        else
            local so_far = 0
            if same then
                if tonumber(c_text) ~= cur.c + 1 then
                    return { 'gap', n, where(c_text, u, s) .. ' skips ahead: the next chunk is '
                        .. (cur.c + 1) }
                end
                so_far = cur.z
            elseif c_text ~= '0' then
                return { 'gap', n, where(c_text, u, s)
                    .. " skips ahead: the message's chunk 0 was never accepted" }
            end
            so_far = so_far + size
            if so_far > total then
                return { 'bad', n, where(c_text, u, s) .. ' brings the message to '
                    .. string.format('%d', so_far) .. ' bytes, over its total size '
                    .. ARGV[i + 4] }
            end
            if c == LAST then
                if so_far ~= total then
                    return { 'bad', n, where(c_text, u, s) .. ' is the last, but the chunks add up to '
                        .. string.format('%d', so_far) .. ' bytes, not the total size '
                        .. ARGV[i + 4] }
                end
                pushed[p], chunk[p] = s, false
            else
                chunk[p] = chunk_encode(s, c, count, total, so_far, u)
                size_out = string.format('%d', so_far)
            end
        end
    else
        meet_persisted(p)
        if pos_cmp(s, c, persisted[p], persisted_chunk[p]) <= 0 then
            status = '1' -- Dup: Kafka acknowledged it
        elseif pos_cmp(s, c, before[p], before_chunk[p]) > 0 then
            status = '1' -- Dup: an earlier record of this batch, written together with this one
        else
            status = '2' -- Unknown: pushed by an earlier batch, not acknowledged (yet?)
            refused = true
        end
    end
    statuses[#statuses + 1] = status
    if stride == 7 then
        sizes[#sizes + 1] = size_out
    end
    return nil
end

-- small(s): |s| < 10^15 < 2^53, so a Lua number holds it, and its neighbours, exactly.
local function small(s)
    return #s <= (s:byte(1) == 45 and 16 or 15)
end

-- overlap_status(p, first, last): the one status every record of a run gets when its
-- first is not above pushed[p] and the statuses need no record's own sequence, else nil.
local function overlap_status(p, first, last)
    if pos_cmp(last, LAST, pushed[p], chunk[p]) > 0 then
        return nil -- it ends above pushed: NotDup from somewhere inside
    end
    meet_persisted(p)
    if pos_cmp(last, LAST, persisted[p], persisted_chunk[p]) <= 0 then
        return '1' -- all acknowledged (a retry of a written batch)
    end
    if pos_cmp(first, LAST, persisted[p], persisted_chunk[p]) <= 0 then
        return nil -- acknowledged up to somewhere inside
    end
    if pos_cmp(first, LAST, before[p], before_chunk[p]) > 0 then
        return '1' -- all raised by earlier records of this batch
    end
    if pos_cmp(last, LAST, before[p], before_chunk[p]) <= 0 then
        return '2' -- all pushed by an earlier batch, none acknowledged
    end
    return nil
end

-- run(n, p, first, last, count): records n+1 .. n+count, of producer p, with sequences first,
-- first+1, ..., last. Returns a reply that ends the script ('bad', 'gap', 'expand'), else nil.
local function run(n, p, first, last, count)
    meet(p)
    if pos_cmp(first, LAST, pushed[p], chunk[p]) > 0 then
        -- Above pushed: the first record is NotDup and raises pushed, so does each next one.
        -- record() does the first, for its chunk rule (a message in progress is abandoned).
        local stop = record(n + 1, p, first, nil)
        if stop or count == 1 then
            return stop
        end
        statuses[#statuses + 1] = string.rep('0', count - 1)
        pushed[p] = last
        return nil
    end
    local whole = overlap_status(p, first, last)
    if whole then
        statuses[#statuses + 1] = string.rep(whole, count)
        refused = refused or whole == '2'
        return nil
    end
    -- Record by record, which needs each sequence: Lua numbers are exact only to 2^53.
    if not (small(first) and small(last)) then
        return EXPAND
    end
    local f = tonumber(first)
    for k = 0, count - 1 do
        local stop = record(n + k + 1, p, string.format('%d', f + k), nil)
        if stop then
            return stop
        end
        if k < count - 1 and statuses[#statuses] == '0' then
            -- pushed[p] is this record's sequence now: the rest of the run is above it.
            statuses[#statuses + 1] = string.rep('0', count - 1 - k)
            pushed[p] = last
            return nil
        end
    end
    return nil
end

-- classify(): every record of the batch; a reply that ends the script, else nil. Reads only.
local function classify()
    local n = 0
    if stride == 4 then
        for i = 6, #ARGV, 4 do
            local count = tonumber(ARGV[i + 3])
            local stop = run(n, ARGV[i], ARGV[i + 1], ARGV[i + 2], count)
            if stop then
                return stop
            end
            n = n + count
        end
        return nil
    end
    for i = 6, #ARGV, stride do
        n = n + 1
        local stop = record(n, ARGV[i], ARGV[i + 1], stride == 7 and i or nil)
        if stop then
            return stop
        end
    end
    return nil
end

local stop = classify()
if stop == EXPAND then
    return stop -- nothing changed, not even the token's call count: the caller re-sends
end
token_count(KEYS[4], guard) -- any other answer counts as a call (see token_holds)
if stop then
    return stop
end

local result = { table.concat(statuses), sizes }
if refused then
    return result -- nothing changed: the whole partition batch is retried later
end

for _, p in ipairs(producers) do
    if pushed[p] ~= before[p] then
        redis.call('HSET', pushed_key, p, pushed[p])
    end
    if chunk[p] ~= before_chunk[p] then
        if chunk[p] then
            redis.call('HSET', pushed_chunk_key, p, chunk[p])
        else
            redis.call('HDEL', pushed_chunk_key, p)
        end
    end
    redis.call('ZADD', seen_key, 'GT', now, p) -- GT: a proxy with a slow clock never moves it back
end

-- Over max_producers: evict the least recently seen producers, never one of this batch and
-- never one with a write in flight (pushed beyond persisted): its retry would read as new
-- and be written twice. Those are stepped over (up to EVICTION_SCAN of them); if too few
-- others are left, the table stays over its bound until their writes are acknowledged.
local EVICTION_SCAN = 1024
local function in_flight(p)
    return redis.call('HGET', pushed_key, p) ~= redis.call('HGET', persisted_key, p)
        or redis.call('HGET', pushed_chunk_key, p) ~= redis.call('HGET', persisted_chunk_key, p)
end
local excess = redis.call('ZCARD', seen_key) - max_producers
local kept = 0 -- ranks 0 .. kept-1 hold producers stepped over; the evicted are gone
while excess > 0 and kept <= EVICTION_SCAN do
    local page = redis.call('ZRANGE', seen_key, kept, kept + excess + #producers + 15)
    if #page == 0 then
        break
    end
    for _, p in ipairs(page) do
        if excess == 0 then
            break
        end
        if before[p] == nil and not in_flight(p) then
            redis.call('HDEL', pushed_key, p)
            redis.call('HDEL', persisted_key, p)
            redis.call('HDEL', pushed_chunk_key, p)
            redis.call('HDEL', persisted_chunk_key, p)
            redis.call('ZREM', seen_key, p)
            result[#result + 1] = p
            excess = excess - 1
        else
            kept = kept + 1
        end
    end
end
return result
