"""Whether Kafka lets a client write a topic: asked of Kafka, as the client.

A Produce request through dedup is written on the proxy's own connections, under the
proxy's principal, so Kafka never checks the client's own right to write: without this
check a client allowed only to read a topic, or not even that, could write it through the
proxy. So before the engine takes a request, the proxy asks Kafka on the client's own
upstream connection (its principal, its session: `FilterContext.ask_as_client`) a Metadata
request for the request's topics with their authorized operations (KIP-430), and refuses
the topics whose answer lacks WRITE, with Kafka's own error (TOPIC_AUTHORIZATION_FAILED).
A Kafka without an authorizer grants every operation. A client that has not authenticated
to a SASL listener gets no answer: its connection is closed by Kafka.

Kafka checks every request; the proxy keeps an answer for `REMEMBERED_S` per connection
(`write_permission_ttl_s`), so an ACL taken away reaches a connection's writes through
dedup within that long; 0 asks at every request, as Kafka checks.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Final, cast

import structlog
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.metadata.v12.response import MetadataResponse, MetadataResponseTopic
from kio.schema.types import TopicName

from dedup import metrics
from proxy.runtime.chain import FilterContext

log = structlog.get_logger(__name__)

REMEMBERED_S: Final = 30.0
# Answers kept per connection, at most (and one request's topics over it): a client naming
# ever new topics (Kafka refuses any name to a client that may not describe it, existing or
# not) must not grow the proxy's memory without bound.
MAX_REMEMBERED: Final = 1000
ASK_TIMEOUT_S: Final = 10.0
WRITE: Final = 1 << 4  # Kafka's AclOperation WRITE (code 4), in the authorized-operations bits
NOT_TOLD: Final = -(2**31)  # the field's value when Kafka was not asked (or is too old)


class PermissionUnknown(Exception):
    """Kafka did not answer whether the client may write (no upstream connection, or
    no answer in time)."""


async def unwritable(
    context: FilterContext, topics: Collection[str], remembered_s: float = REMEMBERED_S
) -> set[str]:
    """The topics Kafka does not let the client of ``context`` write, its answers kept
    ``remembered_s`` (0: asked again at every call). Raises `PermissionUnknown` when Kafka
    was to be asked and did not answer."""
    now = time.monotonic()
    known = context.identity.may_write
    writable: dict[str, bool] = {}
    to_ask: list[str] = []
    for topic in topics:
        remembered = known.get(topic)
        if remembered is None or remembered[1] <= now:
            to_ask.append(topic)
        else:
            writable[topic] = remembered[0]
    if to_ask:  # read first: asking may make room by forgetting what was remembered
        writable |= await _ask(context, to_ask, now + remembered_s)
    return {topic for topic, may in writable.items() if not may}


async def _ask(context: FilterContext, topics: list[str], until: float) -> dict[str, bool]:
    """Whether the client may write each of ``topics``, as Kafka tells it, remembered
    until ``until``."""
    if context.ask_as_client is None:
        raise PermissionUnknown("the client's upstream connection is not open")
    request = MetadataRequest(
        topics=tuple(MetadataRequestTopic(topic_id=None, name=TopicName(t)) for t in topics),
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=True,
    )
    try:
        response = cast(MetadataResponse, await context.ask_as_client(request, ASK_TIMEOUT_S))
    except (OSError, TimeoutError) as exc:
        raise PermissionUnknown(f"Kafka did not answer: {exc or type(exc).__name__}") from exc
    told = {str(topic.name): topic for topic in response.topics}
    known = context.identity.may_write
    _make_room(known, len(topics))
    answers: dict[str, bool] = {}
    for name in topics:
        topic = told.get(name)
        answers[name] = topic is None or _writable(topic)
        known[name] = (answers[name], until)
        if not answers[name]:
            metrics.BAD_INPUT.labels("write_not_authorized").inc()
            log.warning(
                "Kafka does not let the client write the topic; refusing its writes",
                topic=name,
                principal=context.identity.principal,
            )
    return answers


def _make_room(known: dict[str, tuple[bool, float]], wanted: int) -> None:
    """Forget answers whose time is up, and all of them if that leaves too little room."""
    if len(known) + wanted <= MAX_REMEMBERED:
        return
    now = time.monotonic()
    for name in [name for name, (_, until) in known.items() if until <= now]:
        del known[name]
    if len(known) + wanted > MAX_REMEMBERED:
        known.clear()  # asked again when next needed


def _writable(topic: MetadataResponseTopic) -> bool:
    """Whether one topic of Kafka's Metadata answer lets the asking client write it. A
    topic Kafka does not know is not refused here: the produce path answers it."""
    if topic.error_code == ErrorCode.topic_authorization_failed:
        return False
    operations = int(topic.topic_authorized_operations)
    return topic.error_code != ErrorCode.none or operations == NOT_TOLD or bool(operations & WRITE)
