#!/bin/bash
# Starts one Kafka node (KRaft) from the environment:
#   KAFKA_CLUSTER_ID         the cluster id, the same on every node (required)
#   KAFKA_CFG_<NAME>         the server property <name>: lower case, '_' for '.', e.g.
#                            KAFKA_CFG_ADVERTISED_LISTENERS=PLAINTEXT://kafka-1:9092
#   KAFKA_HEAP_OPTS          the heap (default: -Xms256m -Xmx512m)
# node.id defaults to the number that ends the host name (kafka-2 -> 2: a StatefulSet's
# ordinal). The other defaults make a single combined broker and controller; the storage is
# formatted on first start. Kafka runs as PID 1, so SIGTERM is its controlled shutdown.
set -euo pipefail

: "${KAFKA_CLUSTER_ID:?set KAFKA_CLUSTER_ID (the same on every node of the cluster)}"
CONFIG=/opt/kafka/config/server.properties
CLASSPATH='/opt/kafka/libs/*'
host="$(hostname)"
node_id="${KAFKA_CFG_NODE_ID:-${host##*-}}"
[[ "$node_id" =~ ^[0-9]+$ ]] || node_id=1

{
    echo "process.roles=broker,controller"
    echo "node.id=$node_id"
    echo "controller.quorum.voters=$node_id@127.0.0.1:9093"
    echo "listeners=PLAINTEXT://0.0.0.0:9092,CONTROLLER://0.0.0.0:9093"
    echo "advertised.listeners=PLAINTEXT://$host:9092"
    echo "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    echo "inter.broker.listener.name=PLAINTEXT"
    echo "controller.listener.names=CONTROLLER"
    echo "log.dirs=/var/lib/kafka/data"
    echo "num.partitions=1"
    echo "offsets.topic.replication.factor=1"
    echo "transaction.state.log.replication.factor=1"
    echo "transaction.state.log.min.isr=1"
    echo "share.coordinator.state.topic.replication.factor=1"
    echo "share.coordinator.state.topic.min.isr=1"
    echo "group.initial.rebalance.delay.ms=0"
    # The environment's settings come last: java.util.Properties keeps the last value.
    for name in $(compgen -e | grep '^KAFKA_CFG_' | sort); do
        property="${name#KAFKA_CFG_}"
        property="${property,,}"
        echo "${property//_/.}=${!name}"
    done
} >"$CONFIG"

java_opts=(-server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
    -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true
    # Room for a cached direct buffer per thread of a ~100 MB request (deploy/config.py).
    -XX:MaxDirectMemorySize=2g
    -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties)
# shellcheck disable=SC2086 # KAFKA_HEAP_OPTS holds several options
java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} "${java_opts[@]}" -cp "$CLASSPATH" \
    kafka.tools.StorageTool format --ignore-formatted -t "$KAFKA_CLUSTER_ID" -c "$CONFIG"
# shellcheck disable=SC2086
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} "${java_opts[@]}" -cp "$CLASSPATH" \
    kafka.Kafka "$CONFIG"
