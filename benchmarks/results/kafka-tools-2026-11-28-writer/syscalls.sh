#!/bin/bash
# The syscall counts of syscalls-*.txt and the perf profile of perf-*-dedup.txt, as they
# were taken: one proxy (the checkout DIR) serving Kafka's ProducerPerformance (pp.py of
# kafka-tools-2026-11-27-calls) while `strace -f -c` (or `perf record -g`) watches it.
# Needs `dedup-proxy local up --proxies 0` (Kafka on 127.0.0.1:19092, Redis on 16379;
# AB_KAFKA and AB_REDIS name others, as for ab.sh) and the topic created.
#   syscalls.sh strace|perf DIR PORT TOPIC RECORDS SIZE OUT [passthrough]
tool=$1; dir=$2; port=$3; topic=$4; n=$5; size=$6; out=$7; extra=""
[ "$8" = passthrough ] && extra="--no-dedup"
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
calls=$repo/benchmarks/results/kafka-tools-2026-11-27-calls
cd "$dir"
kafka=${AB_KAFKA:-127.0.0.1:19092}; redis=${AB_REDIS:-redis://127.0.0.1:16379/0}
export PYTHONPATH=$dir DEDUP_PROXY_REDIS=$redis DEDUP_PROXY_REDIS_KEY_PREFIX=sc-$RANDOM
"$repo/.venv/bin/python" -m dedup serve --upstream $kafka --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) $extra > /tmp/sc-$port.log 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
if [ "$tool" = strace ]; then
  strace -f -c -o "$out" -p $pid &
else
  perf record -F 2000 -g -p $pid -o "$out" > /dev/null 2>&1 &
fi
watcher=$!
sleep 0.5
(cd "$repo" && PYTHONPATH=$repo "$repo/.venv/bin/python" "$calls/pp.py" 127.0.0.1:$port $topic $n $size 2>/dev/null | tail -1)
kill -INT $watcher; wait $watcher
kill -TERM $pid; wait $pid
