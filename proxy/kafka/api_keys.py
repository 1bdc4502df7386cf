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
    SASL_AUTHENTICATE = 36
    DESCRIBE_CLUSTER = 60
    SHARE_FETCH = 78
    SHARE_ACKNOWLEDGE = 79
