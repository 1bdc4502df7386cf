"""Which incarnation of a topic a partition's dedup state belongs to.

Kafka gives every topic a random id when it is created (KIP-516; Metadata v10 and later
report it). A topic deleted and created again under its old name gets a new id and an
empty log, while the dedup state (the maps, Redis's copy, the snapshots) is known by the
name. Left alone, the new topic's first records would read as duplicates of the old
topic's, be dropped and be answered success: lost.

So a partition's state carries the id of the topic it was rebuilt from (`dedup.recovery`
reads it before the log), snapshots carry it too, and the engine confirms the id with the
partition's leader before it answers a request in which it dropped records
(`DedupEngine._topic_unchanged`). Only such answers can lose records to a stale state: a
record that is written is in the log whatever the state believed. Dropped records are the
exception (retries, a restarted producer sending again), so the extra round trip is not on
the common path.

Each call asks the cluster anew, on a connection of its own per broker (never behind a
large Produce request): an answer is only good for a request that arrived before it was
asked.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.types import TopicName

from dedup import metrics
from proxy.kafka.topology import Endpoint

# Its own connection to each broker, apart from the writer's lanes (0, 1, ...).
METADATA_LANE = -1
# A topic id as this module gives it: the UUID's text.
TOPIC_ID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def recovery_token(owner_epoch: str, topic_id: str | None) -> str:
    """A partition's recovery token (`dedup.recovery`: unique per recovery) naming, last,
    the id of the topic the state was rebuilt from: an instance that reads Redis's copy of
    a partition it does not own can tell which topic the copy is of (`topic_id_of`)."""
    return f"{owner_epoch}.{uuid.uuid4().hex}.{topic_id or 'unknown'}"


def topic_id_of(token: str) -> str | None:
    """The topic id a recovery token names; None for none (or a token of an older proxy)."""
    last = token.rsplit(".", 1)[-1]
    return last if TOPIC_ID.fullmatch(last) else None


class UnknownTopic(LookupError):
    """The cluster has no topic of this name (deleted, and not created again yet)."""


class MetadataLink(Protocol):
    """A connection to a broker (`proxy.kafka.upstream_client.UpstreamClient`)."""

    async def request(self, payload: Any) -> Any: ...


class TopicIds:
    def __init__(
        self,
        connect: Callable[[Endpoint, int], Awaitable[MetadataLink]],
        known_upstreams: Callable[[], Sequence[Endpoint]],
    ) -> None:
        self._connect = connect  # (broker, lane) -> an open connection (`dedup.links`)
        self._known_upstreams = known_upstreams

    async def of(self, topic: str, broker: Endpoint | None = None) -> str | None:
        """The topic's id now, asked of ``broker`` first (the partition's leader: the broker
        the client wrote to), then of the other brokers known, in turn (a leader that went
        away); None when the cluster gives topics no id (a ZooKeeper cluster older than
        Kafka 2.8).
        Raises `UnknownTopic`, and OSError or TimeoutError when no broker answered."""
        found = (await self.answers([topic], broker))[topic]
        if isinstance(found, Exception):
            raise found
        return found

    async def answers(
        self, topics: Sequence[str], broker: Endpoint | None = None
    ) -> dict[str, str | Exception | None]:
        """Each topic's answer now, in one request: its id, None (`of`), or the error it
        was answered with (`UnknownTopic`, OSError). Raises OSError or TimeoutError when
        no broker answered."""
        request = MetadataRequest(
            topics=tuple(MetadataRequestTopic(topic_id=None, name=TopicName(t)) for t in topics),
            allow_auto_topic_creation=False,
            include_topic_authorized_operations=False,
        )
        known = [endpoint for endpoint in self._known_upstreams() if endpoint != broker]
        endpoints = known if broker is None else [broker, *known]
        error: Exception = OSError("no upstream broker known")
        for endpoint in endpoints:
            metrics.TOPIC_ID_LOOKUPS.inc()
            try:
                link = await self._connect(endpoint, METADATA_LANE)
                response = await link.request(request)
            except (OSError, TimeoutError) as exc:
                error = exc
                continue
            return {topic: _answer(response, topic) for topic in topics}
        raise error


def _answer(response: Any, topic: str) -> str | Exception | None:
    try:
        return _topic_id(response, topic)
    except (UnknownTopic, OSError) as exc:
        return exc


def _topic_id(response: Any, topic: str) -> str | None:
    for found in response.topics:
        if found.name != topic:
            continue
        if found.error_code == ErrorCode.unknown_topic_or_partition:
            raise UnknownTopic(f"topic {topic} does not exist")
        if found.error_code:
            raise OSError(f"metadata of topic {topic}: error code {int(found.error_code)}")
        topic_id = found.topic_id
        if topic_id is None or topic_id == uuid.UUID(int=0):
            return None
        return str(topic_id)
    raise OSError(f"the metadata answer does not name topic {topic}")
