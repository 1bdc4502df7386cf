#!/bin/bash
# The A/B of "Fetch answers read at once" (benchmarks/README.md): one pass-through proxy at
# a time (the working tree at 8a3bb3a) in front of the `kafka_tools` environment, Kafka's
# ConsumerPerformance reading 5,000,000 records of 100 B (topic prof-consume, 1 partition,
# written first by ProducerPerformance) through it, and directly between variants.
# The variants were switched by a temporary patch, not committed: in proxy/kafka/wire.py
#   PIECEWISE_FRAME_BYTES = int(os.environ.get("XPIECE", 1 << 20))
# and in proxy/kafka/upstream_client.py open_upstream
#   asyncio.open_connection(..., limit=int(os.environ.get("XLIMIT", 65536)))
# ab-1.txt is the first run (variants head, limit1m, piece8m, both = l1m-p8m), ab-2.txt the
# second. proxy_cpu_ticks: the proxy's utime + stime over the consumer's run, in 1/100 s.
# one pass-through proxy per variant (env), ConsumerPerformance through it; prints fetch MB/s
cd /work/main
LIBS=~/.cache/kafka-dedup-proxy/kafka-4.3.1/libs
run() {  # label, env...
  local label=$1; shift
  env "$@" DEDUP_PROXY_REDIS=redis://127.0.0.1:17579/0 DEDUP_PROXY_REDIS_KEY_PREFIX=ab-pt .venv/bin/python -m dedup serve --upstream 127.0.0.1:22092 --listen 127.0.0.1:24512 --admin 127.0.0.1:24500 --no-dedup --broker-port-base 24513 > /tmp/consab-proxy.log 2>&1 &
  local pid=$!
  sleep 5
  local c0=$(awk '{print $14+$15}' /proc/$pid/stat)
  java -cp "$LIBS/*" org.apache.kafka.tools.ConsumerPerformance --bootstrap-server 127.0.0.1:24512 --topic prof-consume --num-records 5000000 --group ab-$RANDOM --timeout 20000 > /tmp/consab-run.txt 2>&1
  local c1=$(awk '{print $14+$15}' /proc/$pid/stat)
  kill $pid; wait $pid 2>/dev/null
  echo "$label $(tail -n 1 /tmp/consab-run.txt | awk -F', ' '{print "fetch MB/s", $9}') proxy_cpu_ticks $((c1-c0))"
}
direct() {
  java -cp "$LIBS/*" org.apache.kafka.tools.ConsumerPerformance --bootstrap-server 127.0.0.1:22092 --topic prof-consume --num-records 5000000 --group ab-$RANDOM --timeout 20000 > /tmp/consab-run.txt 2>&1
  echo "direct $(tail -n 1 /tmp/consab-run.txt | awk -F', ' '{print "fetch MB/s", $9}')"
}
for i in 1 2 3; do
  direct
  run head
  run l1m-p8m XLIMIT=1048576 XPIECE=8388608
  run l1m-p4m XLIMIT=1048576 XPIECE=4194304
  run l256k-p4m XLIMIT=262144 XPIECE=4194304
  run l64k-p4m XPIECE=4194304
done
