# Shell helpers of deploy/setup.sh and deploy/containers/engine.sh. The sourcing script
# defines die() first and sets LIB_TAG (its name, for temporary files).

# A property of a Maven descriptor, <name>value</name> on one line (as deploy/paths.py reads it).
pom_property() {
    local value
    value="$(sed -n "s:.*<$2>[[:space:]]*\([^<[:space:]]*\)[[:space:]]*</$2>.*:\1:p" "$1" | head -n1)"
    [ -n "$value" ] || die "$1 has no property $2"
    echo "$value"
}

# An XDG base directory: the variable's value when it is absolute, else the default (the
# same rule as deploy/paths.py and dedup/spark/runtime.py).
xdg_dir() {
    local value="$1" default="$2"
    if [[ "$value" == /* ]]; then echo "$value"; else echo "$default"; fi
}

# Runs a noisy command with its output in a log file, shown (tail) only when it fails.
quietly() {
    local log status=0
    log="$(mktemp "${TMPDIR:-/tmp}/dedup-${LIB_TAG:-deploy}.XXXXXX")"
    "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        tail -n 60 "$log" >&2
        rm -f "$log"
        die "failed ($status): $*"
    fi
    rm -f "$log"
}
