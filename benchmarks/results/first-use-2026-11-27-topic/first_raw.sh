#!/bin/bash
# first_raw.sh DIR PORT TOPIC PARTITIONS: as ../first-use-2026-11-27/first_raw.sh (its
# first_raw.py), and also the connections to Kafka the proxy opened and closed meanwhile
# (TIME_WAIT to port 22092, before and after) and its recovery runs.
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd); dir=$1; port=$2; topic=$3; n=$4
cd "$dir"
export PYTHONPATH=$dir DEDUP_PROXY_REDIS=redis://127.0.0.1:17579/0 DEDUP_PROXY_REDIS_KEY_PREFIX=first-$RANDOM
"$repo/.venv/bin/python" -m dedup serve --upstream 127.0.0.1:22092 --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) > /tmp/first-$port.log 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
closed() { ss -tan state time-wait '( dport = :22092 )' | tail -n +2 | wc -l; }
c0=$(closed)
out=$(cd "$repo" && PYTHONPATH=$repo "$repo/.venv/bin/python" "$here/../first-use-2026-11-27/first_raw.py" $port $topic $n)
c1=$(closed)
kill -TERM $pid; wait $pid
echo "$(basename "$dir") $n partitions: $out; connections to Kafka opened and closed meanwhile: $((c1-c0)); recovery runs: $(grep -c 'recovering partitions' /tmp/first-$port.log)"
