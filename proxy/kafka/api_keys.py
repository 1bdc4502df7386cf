"""Kafka API keys the proxy refers to by name (the protocol's numbers, written once)."""

from __future__ import annotations

from enum import IntEnum


class ApiKey(IntEnum):
    PRODUCE = 0
    FETCH = 1
    METADATA = 3
    FIND_COORDINATOR = 10
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    DESCRIBE_CONFIGS = 32
    ALTER_CONFIGS = 33
    SASL_AUTHENTICATE = 36
    CREATE_PARTITIONS = 37
    INCREMENTAL_ALTER_CONFIGS = 44
    ALTER_PARTITION_REASSIGNMENTS = 45
    LIST_PARTITION_REASSIGNMENTS = 46
    DESCRIBE_CLUSTER = 60
    UNREGISTER_BROKER = 64
    DESCRIBE_TOPIC_PARTITIONS = 75
    SHARE_FETCH = 78
    SHARE_ACKNOWLEDGE = 79
