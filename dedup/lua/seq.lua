-- Shared by every dedup script (prepended to each one before SCRIPT LOAD).
--
-- Sequence ids are signed 64-bit integers. Lua numbers are doubles, exact only up to 2^53, so
-- sequences never become Lua numbers: they travel and are stored as canonical decimal strings
-- ("-12", "0", "9223372036854775807": no "+", no leading zeros, no "-0"; Python's str(int)
-- writes exactly that) and are compared here, exactly.

-- seq_cmp(a, b): -1 when a < b, 0 when a == b, 1 when a > b.
-- Sign first, then length (more digits = larger magnitude), then digit by digit.
local function seq_cmp(a, b)
    local a_neg, b_neg = a:byte(1) == 45, b:byte(1) == 45 -- 45 is "-"
    if a_neg ~= b_neg then
        return a_neg and -1 or 1
    end
    local sign = a_neg and -1 or 1 -- for negatives the larger magnitude is the smaller number
    if #a ~= #b then
        return (#a < #b and -1 or 1) * sign
    end
    for i = 1, #a do -- byte by byte: Lua's "<" on strings follows the locale (strcoll)
        local x, y = a:byte(i), b:byte(i)
        if x ~= y then
            return (x < y and -1 or 1) * sign
        end
    end
    return 0
end

-- token_holds(key, guard): "" accepts any state. Otherwise guard is "<token> <calls>":
-- the partition's token key must hold that token (a flushed or replaced Redis has none, or
-- another one) and count at least <calls> calls: the calls made with this token whose
-- success its owner has seen. Fewer means Redis lost writes it had acknowledged (a failover
-- to a replica that lagged, an append-only file not yet synced). Changes nothing.
local function token_holds(key, guard)
    if guard == '' then
        return true
    end
    local token, calls = string.match(guard, '^(%S+) (%d+)$')
    local held = redis.call('GET', key)
    if not token or not held then
        return false
    end
    local held_token, held_calls = string.match(held, '^(%S+) (%d+)$')
    return held_token == token and tonumber(held_calls) >= tonumber(calls)
end

-- token_count(key, guard): counts this call under a guard token_holds accepted, so its
-- owner, which counts every call Redis answered, can ask for it next time.
local function token_count(key, guard)
    if guard == '' then
        return
    end
    local token, calls = string.match(redis.call('GET', key), '^(%S+) (%d+)$')
    redis.call('SET', key, token .. ' ' .. string.format('%d', tonumber(calls) + 1))
end

-- token_matches(key, guard): token_holds, and a match counts this call.
local function token_matches(key, guard)
    if not token_holds(key, guard) then
        return false
    end
    token_count(key, guard)
    return true
end

-- Chunked messages (dedup/chunks.py): a producer's message in progress is kept beside its
-- sequence as "sequence chunk_id chunk_count total_size size uuid" (the uuid, which may hold
-- spaces, runs to the end). A record's position is (sequence, chunk id); a whole record, or
-- a last chunk, is at (sequence, LAST), after every chunk of its sequence.
local LAST = 2147483648

local function chunk_decode(text)
    local s, c, n, t, z, u = string.match(text, '^(%S+) (%d+) (%d+) (%d+) (%d+) (.*)$')
    return { s = s, c = tonumber(c), n = tonumber(n), t = tonumber(t), z = tonumber(z), u = u }
end

local function chunk_encode(s, c, n, t, z, u)
    return s .. ' ' .. string.format('%d', c) .. ' ' .. string.format('%d', n) .. ' '
        .. string.format('%d', t) .. ' ' .. string.format('%d', z) .. ' ' .. u
end

-- pos_cmp(s, c, seq, chunk): the position (s, c) against the one a state holds: its chunk
-- in progress if any (encoded, or false), else its sequence (or false) at LAST. A state
-- holding nothing is below every position (1).
local function pos_cmp(s, c, seq, chunk)
    local other_s, other_c
    if chunk then
        other_s, other_c = string.match(chunk, '^(%S+) (%d+)')
        other_c = tonumber(other_c)
    elseif seq then
        other_s, other_c = seq, LAST
    else
        return 1
    end
    local by_seq = seq_cmp(s, other_s)
    if by_seq ~= 0 then
        return by_seq
    end
    if c == other_c then
        return 0
    end
    return c < other_c and -1 or 1
end
