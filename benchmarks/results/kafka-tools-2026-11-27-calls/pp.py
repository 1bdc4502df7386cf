"""Kafka's ProducerPerformance against one bootstrap (ab.sh, perfsplit.sh):
pp.py BOOTSTRAP TOPIC RECORDS SIZE, with acks=all and idempotence on as in kafka_tools."""

import subprocess
import sys

from deploy.local import java_tool_command

boot, topic, n, size = sys.argv[1:5]
command = java_tool_command(
    "org.apache.kafka.tools.ProducerPerformance",
    *("--bootstrap-server", boot, "--topic", topic, "--num-records", n),
    *("--record-size", size, "--throughput", "-1"),
    *("--command-property", "acks=all", "enable.idempotence=true", "client.id=ab"),
)
subprocess.run(command, check=True)
