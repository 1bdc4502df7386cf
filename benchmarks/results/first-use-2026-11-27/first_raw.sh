#!/bin/bash
# first_raw.sh DIR PORT TOPIC PARTITIONS: a fresh proxy from the checkout DIR; the time of one
# raw Produce request to every partition of TOPIC (first_raw.py), and the proxy's log in
# /tmp/first-PORT.log. Needs the private environment up (Kafka on 127.0.0.1:22092, Redis on
# 17579; see ../../README.md) and TOPIC created with PARTITIONS partitions.
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd); dir=$1; port=$2; topic=$3; n=$4
cd "$dir"
export PYTHONPATH=$dir DEDUP_PROXY_REDIS=redis://127.0.0.1:17579/0 DEDUP_PROXY_REDIS_KEY_PREFIX=first-$RANDOM
"$repo/.venv/bin/python" -m dedup serve --upstream 127.0.0.1:22092 --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) > /tmp/first-$port.log 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
out=$(cd "$repo" && PYTHONPATH=$repo "$repo/.venv/bin/python" "$here/first_raw.py" $port $topic $n)
kill -TERM $pid; wait $pid
echo "$(basename "$dir") $n partitions: $out"
