#!/bin/bash
# One proxy of this checkout under cProfile, serving Kafka's ProducerPerformance (pp.py of
# kafka-tools-2026-11-27-calls: acks=all, idempotence on); its profile written to OUT at
# SIGTERM. Needs `dedup-proxy local up` (Kafka 127.0.0.1:19092, Redis 16379); AB_KAFKA and
# AB_REDIS name others. Run it twice, RECORDS and 2 x RECORDS, and give both to calls.py.
#   cprof.sh PORT TOPIC RECORDS SIZE OUT [passthrough]
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
pp=$repo/benchmarks/results/kafka-tools-2026-11-27-calls/pp.py
port=$1; topic=$2; n=$3; size=$4; out=$5; extra=""
[ "$6" = passthrough ] && extra="--no-dedup"
kafka=${AB_KAFKA:-127.0.0.1:19092}; redis=${AB_REDIS:-redis://127.0.0.1:16379/0}
cd "$repo"
export DEDUP_PROXY_REDIS=$redis DEDUP_PROXY_REDIS_KEY_PREFIX=cp-$RANDOM
.venv/bin/python -m cProfile -o "$out" -m dedup serve --upstream $kafka --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) $extra > /tmp/cp-$port.log 2>&1 &
pid=$!
for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
.venv/bin/python "$pp" 127.0.0.1:$port $topic $n $size 2>/dev/null | tail -1
curl -s 127.0.0.1:$((port-12))/metrics | grep -E '^dedup_proxy_requests_total\{api="produce"'
kill -TERM $pid; wait $pid
