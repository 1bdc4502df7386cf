#!/bin/bash
# The by-hand A/B of cpu-ab-by-hand.txt, as it was run: one proxy (the checkout DIR) serving
# Kafka's ProducerPerformance through pp.py; prints records/s and the proxy's CPU per MB.
# Needs the environment of `python -m benchmarks.kafka_tools --keep-env` up (Kafka on
# 127.0.0.1:22092, Redis on 17579) and the topic created; AB_KAFKA and AB_REDIS name others
# (`dedup-proxy local up`: 127.0.0.1:19092 and redis://127.0.0.1:16379/0).
#   ab.sh DIR PORT TOPIC RECORDS SIZE [passthrough]
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
dir=$1; port=$2; topic=$3; n=$4; size=$5; extra=""
[ "$6" = passthrough ] && extra="--no-dedup"
kafka=${AB_KAFKA:-127.0.0.1:22092}; redis=${AB_REDIS:-redis://127.0.0.1:17579/0}
cd "$dir"
export PYTHONPATH=$dir DEDUP_PROXY_REDIS=$redis DEDUP_PROXY_REDIS_KEY_PREFIX=ab-$RANDOM
"$repo/.venv/bin/python" -m dedup serve --upstream $kafka --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) $extra > /tmp/ab-$port.log 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
c0=$(awk '{print $14+$15}' /proc/$pid/stat)
out=$(cd "$repo" && PYTHONPATH=$repo "$repo/.venv/bin/python" "$here/pp.py" 127.0.0.1:$port $topic $n $size 2>/dev/null | tail -1)
c1=$(awk '{print $14+$15}' /proc/$pid/stat)
kill -TERM $pid; wait $pid
rate=$(echo "$out" | grep -o "[0-9.]* records/sec" | head -1)
cpu=$(echo "($c1-$c0)/100" | bc -l)
mb=$(echo "$n*$size/1048576" | bc -l)
printf "%-12s %-12s %s  cpu %.2fs  %.1f ms/MB\n" "$(basename "$dir")" "${6:-dedup}" "$rate" $cpu $(echo "$cpu*1000/$mb" | bc -l)
