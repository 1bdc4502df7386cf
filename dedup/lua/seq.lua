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

-- token_matches(key, token): "" accepts any state; otherwise the partition's token key must
-- hold exactly `token` (a flushed or replaced Redis has none, or another one).
local function token_matches(key, token)
    return token == '' or redis.call('GET', key) == token
end
