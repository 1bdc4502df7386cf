#!/bin/bash
# perf-dso-*.txt, as it was run: `perf record` on one proxy while ProducerPerformance runs
# through it, then the CPU samples by shared object (the interpreter, the kernel, ...).
#   perfsplit.sh dedup|passthrough PORT TOPIC RECORDS SIZE OUT
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../.." && pwd)
mode=$1; port=$2; topic=$3; n=$4; size=$5; out=$6
cd "$repo"
export PYTHONPATH=$repo DEDUP_PROXY_REDIS=redis://127.0.0.1:17579/0 DEDUP_PROXY_REDIS_KEY_PREFIX=ps-$RANDOM
extra=""; [ "$mode" = passthrough ] && extra="--no-dedup"
.venv/bin/python -m dedup serve --upstream 127.0.0.1:22092 --listen 127.0.0.1:$port \
  --admin 127.0.0.1:$((port-12)) --broker-port-base $((port+1)) $extra > "$out.log" 2>&1 &
pid=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.2; done
sleep 1
perf record -F 999 -g -p $pid -o "$out.perf" > /dev/null 2>&1 &
perf_pid=$!
sleep 0.5
.venv/bin/python "$here/pp.py" 127.0.0.1:$port $topic $n $size 2>/dev/null | tail -1
kill -INT $perf_pid; wait $perf_pid
kill -TERM $pid; wait $pid
perf report -i "$out.perf" --no-children --sort dso --stdio -g none -n 2>/dev/null | grep -v "^$"
