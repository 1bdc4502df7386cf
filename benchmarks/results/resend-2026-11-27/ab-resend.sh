#!/bin/bash
# A blind re-send through one dedup proxy (the checkout DIR): resend.py writes N records of
# one producer, then sends the same N again (every one a duplicate). Needs the environment
# of `python -m benchmarks.kafka_tools --keep-env` up and TOPIC created.
#   ab-resend.sh DIR PORT TOPIC N
dir=$1; port=$2; topic=$3; n=$4; here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
cd "$dir"
export PYTHONPATH=$dir DEDUP_PROXY_REDIS=redis://127.0.0.1:17579/0 DEDUP_PROXY_REDIS_KEY_PREFIX=dup-$RANDOM
"$repo/.venv/bin/python" -m dedup serve --upstream 127.0.0.1:22092 --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) > /tmp/dup-$port.log 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
out=$(cd "$repo" && PYTHONPATH=$repo "$repo/.venv/bin/python" $repo/benchmarks/results/resend-2026-11-27/resend.py 127.0.0.1:$port $topic $n 2>/dev/null | tail -1)
kill -TERM $pid; wait $pid
echo "$(basename $dir) $out"
