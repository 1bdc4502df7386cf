"""Kafka's answers to the proxy's question whether a client may write topics
(`dedup.write_permissions`), for tests without a broker: Metadata v12 responses, as kio
decodes them, with each topic's authorized operations."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12 import response as metadata
from kio.schema.types import TopicName
from kio.static.primitive import i32, i32Timedelta

from dedup.write_permissions import WRITE

READ, DESCRIBE = 1 << 3, 1 << 8  # Kafka's AclOperation codes 3 and 8, as bits
EVERYTHING = (1 << 13) - 4  # what a Kafka without an authorizer grants: codes 2..12


class KafkaAnswering:
    """A client's upstream connection that answers the proxy's Metadata requests: each
    topic with the operations ``granted`` gives it (`EVERYTHING` unless named), or the
    error ``errors`` gives it; records what it was asked."""

    def __init__(
        self,
        granted: Mapping[str, int] | None = None,
        errors: Mapping[str, ErrorCode] | None = None,
    ) -> None:
        self.granted = dict(granted or {})
        self.errors = dict(errors or {})
        self.asked: list[list[str]] = []

    async def __call__(self, request: Any, timeout_s: float) -> Any:
        names = [str(topic.name) for topic in request.topics]
        self.asked.append(names)
        assert request.include_topic_authorized_operations
        return metadata.MetadataResponse(
            throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
            brokers=(),
            topics=tuple(
                metadata.MetadataResponseTopic(
                    error_code=self.errors.get(name, ErrorCode.none),
                    name=TopicName(name),
                    topic_id=None,
                    partitions=(),
                    topic_authorized_operations=i32(self.granted.get(name, EVERYTHING)),
                )
                for name in names
            ),
        )


__all__ = ["DESCRIBE", "EVERYTHING", "READ", "WRITE", "KafkaAnswering"]
