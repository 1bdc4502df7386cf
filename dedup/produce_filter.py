"""Produce requests through the dedup engine: the one request the proxy answers itself.

A request filter (`proxy.runtime.chain`). A Produce request whose topics have dedup
enabled is decoded, run through the engine (check, rebuild, idempotent write), and
answered by the proxy in the client's version. Anything else (transactional, dedup
disabled everywhere it writes) is forwarded as it is, undecoded where no policy can
enable dedup at all; a transactional one from an authenticated client only once the
producer names it carries are its principal's (`DedupEngine.refuse_foreign_names_in_transaction`).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import sys
from collections.abc import Collection, Set
from dataclasses import dataclass, replace
from typing import Any, Final, cast

import structlog
from kio.schema.errors import ErrorCode
from kio.schema.types import BrokerId
from kio.static.primitive import i32, i64
from kio.static.protocol import ResponsePayload

from dedup.batches import copy_of, records_declared
from dedup.engine import Admission, DedupEngine, PartitionAnswer
from dedup.write_permissions import REMEMBERED_S, PermissionUnknown, unwritable
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.error_codes import error_code
from proxy.kafka.produce_codec import PartitionRow, encode_produce_answers
from proxy.kafka.produce_decoder import decode_produce_request
from proxy.kafka.schemas import response_header_is_flexible, response_type
from proxy.kafka.topology import Endpoint
from proxy.runtime.chain import (
    ClientSoftware,
    EncodedResponse,
    FilterContext,
    Forward,
    LocalAnswer,
    RequestDecision,
    RequestFrame,
    Respond,
)

log = structlog.get_logger(__name__)

# A Produce request of this size or more is decoded off the event loop: kio decodes on it,
# and copies the records while it does (some 17 ms for 32 MB, every other connection held).
DECODE_OFF_LOOP_BYTES = 1 << 20


Refusals = dict[tuple[str, int], PartitionAnswer]
"""The answers of the partitions a request is refused, nothing written to them."""


@dataclass(frozen=True, slots=True)
class _Written:
    """A Produce request as the client sent it, the part of it written through dedup, and
    the answers of the rest (topics the client may not write)."""

    sent: Any
    written: Any
    refusals: Refusals


class DedupProduceFilter:
    request_keys = frozenset({ApiKey.PRODUCE})

    def __init__(
        self,
        engine: DedupEngine,
        numbering_from_base: Collection[str] = (),
        write_permission_ttl_s: float = REMEMBERED_S,
    ) -> None:
        """``numbering_from_base``: client software names (KIP-511) that number their
        reports from the base offset besides those `numbers_reports_from_base` knows;
        ``write_permission_ttl_s``: how long Kafka's answer whether a client may write a
        topic is kept (`dedup.write_permissions`)."""
        self._engine = engine
        self._numbering_from_base = frozenset(numbering_from_base)
        self._write_permission_ttl_s = write_permission_ttl_s
        self._running: set[asyncio.Task[LocalAnswer]] = set()

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        if not await self._engine.dedup_anywhere():
            return Forward()
        request: Any = await _decoded(frame)  # one kio class per version, the same fields
        refused = await self._engine.refuse_foreign_names_in_transaction(
            request, context.identity.principal
        )
        if refused is not None:
            return Respond.now(produce_answer(frame.header.api_version, refused, request))
        written: Any = request
        refusals: Refusals = {}
        if request.transactional_id is None:  # else forwarded: Kafka checks it itself
            written, refusals = await _writable_part(request, context, self._write_permission_ttl_s)
            if written is None:
                return Respond.now(produce_answer(frame.header.api_version, refusals, request))
        # Forwarded as the client sent it, refused topics too (dedup disabled for the rest):
        # Kafka checks the client's own request, and refuses those itself.
        admission = await self._engine.admit(
            written, context.identity.principal, context.connection
        )
        if admission is None:
            return Forward()
        assert context.upstream is not None, "a request arrives only once upstream is connected"
        # The write runs to its end even if the client goes away (its connection's tasks are
        # cancelled): the writer's sequences and the dedup state must not stop half-way.
        task = asyncio.create_task(
            self._answer(
                frame.header.api_version,
                _Written(request, written, refusals),
                admission,
                context.upstream,
                context.software,
            )
        )
        self._running.add(task)
        # The connection waits on its own future, which the task's end settles (what
        # asyncio.shield does, in fewer steps): cancelling the wait leaves the task running.
        answer: asyncio.Future[LocalAnswer] = asyncio.get_running_loop().create_future()
        task.add_done_callback(functools.partial(self._finished, answer))
        return Respond(answer)

    def _finished(
        self, answer: asyncio.Future[LocalAnswer], task: asyncio.Task[LocalAnswer]
    ) -> None:
        self._running.discard(task)
        if task.cancelled():
            answer.cancel()
            return
        error = task.exception()
        if error is not None:
            log.error("produce through dedup failed", error=repr(error))
        if answer.done():  # the connection stopped waiting
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(task.result())

    async def _answer(
        self,
        version: int,
        request: _Written,
        admission: Admission,
        broker: Endpoint,
        software: ClientSoftware,
    ) -> LocalAnswer:
        answers = await self._engine.produce(request.written, admission, broker)
        if request.refusals:
            answers = answers | request.refusals
        if numbers_reports_from_base(software, self._numbering_from_base):
            answers = numbered_below_zero(answers, request.sent)
        return produce_answer(version, answers, request.sent)

    async def drain(self) -> None:
        """Wait for every write already taken (graceful shutdown)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


async def _writable_part(
    request: Any, context: FilterContext, remembered_s: float
) -> tuple[Any | None, Refusals]:
    """The part of the request Kafka lets the client write (the proxy writes it under its
    own principal: `dedup.write_permissions`), None if no part, and the answers of the
    rest: the topics without `Write` refused as Kafka refuses them, the others written, as
    Kafka writes the authorized topics of a request; every topic retriable when whether
    the client may write is unknown."""
    topics = {str(topic.name) for topic in request.topic_data}
    try:
        refused = await unwritable(context, topics, remembered_s)
    except PermissionUnknown as exc:
        unknown = PartitionAnswer(
            ErrorCode.not_enough_replicas,
            error_message=f"not written: whether the client may write is unknown ({exc})",
        )
        return None, _answers_of(request, topics, unknown)
    if not refused:
        return request, {}
    refusal = PartitionAnswer(
        ErrorCode.topic_authorization_failed,
        error_message="Kafka does not let this client write the topic",
    )
    kept = tuple(topic for topic in request.topic_data if str(topic.name) not in refused)
    written = replace(request, topic_data=kept) if kept else None
    return written, _answers_of(request, refused, refusal)


def _answers_of(request: Any, topics: Set[str], answer: PartitionAnswer) -> Refusals:
    """``answer`` for every partition of ``topics`` the request names."""
    return {
        (str(topic.name), int(part.index)): answer
        for topic in request.topic_data
        if str(topic.name) in topics
        for part in topic.partition_data
    }


# Clients built on librdkafka, by the software name their ApiVersions request gives (read in
# their sources): librdkafka's default, and Confluent's clients for Python, Go, .NET and
# JavaScript. Go's and .NET's give librdkafka's bare version as theirs ("2.6.1"), so only
# their name tells; Python's and JavaScript's versions name it too ("2.6.1-rdkafka-2.6.1",
# "1.2.0-librdkafka-2.6.1").
LIBRDKAFKA_CLIENTS: Final = frozenset(
    {
        "librdkafka",
        "confluent-kafka-python",
        "confluent-kafka-go",
        "confluent-kafka-dotnet",
        "confluent-kafka-javascript",
    }
)


def numbers_reports_from_base(
    software: ClientSoftware, also: Collection[str] = frozenset()
) -> bool:
    """Whether the client numbers a batch's delivery reports from the answer's base offset,
    whatever it is: librdkafka does (base, base + 1, ... for the batch's records, from -1
    too), and so does every client built on it: one of `LIBRDKAFKA_CLIENTS`, one of
    ``also`` (the operator's list), or any whose name or version says "rdkafka". Kafka's
    Java client and kafka-python report -1 for every record of a batch answered -1."""
    return (
        software.name in LIBRDKAFKA_CLIENTS
        or software.name in also
        or "rdkafka" in software.name
        or "rdkafka" in software.version
    )


def numbered_below_zero(
    answers: dict[tuple[str, int], PartitionAnswer], request: Any
) -> dict[tuple[str, int], PartitionAnswer]:
    """The answers for a client that numbers its reports from the base offset: a batch
    written or dropped with no base offset right for all its records (-1) is answered
    with minus its record count, so that every record's report names a negative offset,
    none, as the Java client reports -1 for each. From -1, the records after the first
    would be reported at offsets 0, 1, 2 ...: other records'."""
    numbered = answers  # copied at the first answer to change: most requests change none
    for topic in request.topic_data:
        for part in topic.partition_data:
            key = (str(topic.name), int(part.index))
            answer = numbered[key]
            if answer.error_code or answer.base_offset != -1 or part.records is None:
                continue
            count = records_declared(part.records)
            if count is not None and count > 1:
                if numbered is answers:
                    numbered = dict(answers)
                numbered[key] = replace(answer, base_offset=-count)
    return numbered


async def _decoded(frame: RequestFrame) -> Any:
    """The request's kio entity; a large one decoded in a worker thread, its records copied
    with the GIL released (`proxy.kafka.produce_decoder`), so the event loop serves the
    proxy's other connections meanwhile."""
    if frame.decoded is None and len(frame.payload) >= DECODE_OFF_LOOP_BYTES:
        header = frame.header
        request = await asyncio.to_thread(
            decode_produce_request, header.api_version, frame.payload, header.body_offset, copy_of
        )
        if request is not None:
            frame.keep_decoded(request)
    return frame.decode()  # kio's, for what the hand decoder leaves to it (bad input too)


Answered = dict[str, tuple[Any, dict[int, PartitionAnswer]]]
"""Per topic: its name as the request spelled it, and each partition's answer."""


def produce_answer(
    version: int, answers: dict[tuple[str, int], PartitionAnswer], request: Any
) -> LocalAnswer:
    """What `produce_response` answers, its bytes written at once (no entity per request)
    unless a partition is sent to another instance (a tagged field, kio's to write)."""
    answered = _answered(answers, request)
    topics: list[tuple[str, list[PartitionRow]]] = []
    for name, partitions in answered.values():
        rows: list[PartitionRow] = []
        for index, a in partitions.items():
            if a.redirect is not None:
                return _response(version, answered)
            rows.append(
                (
                    index,
                    a.error_code,
                    a.base_offset,
                    a.log_append_time_ms,
                    a.log_start_offset,
                    (),
                    a.error_message,
                )
            )
        topics.append((str(name), rows))
    body = encode_produce_answers(version, topics)
    if body is None:  # a version whose layout the encoder does not know
        return _response(version, answered)
    return EncodedResponse(body, response_header_is_flexible(ApiKey.PRODUCE, version))


def produce_response(
    version: int, answers: dict[tuple[str, int], PartitionAnswer], request: Any
) -> ResponsePayload:
    """The kio ProduceResponse of the client's version, partitions in request order.

    A partition named twice gets one entry, as from Kafka's broker (which keeps one entry
    per partition), and so does a topic named twice.
    """
    return _response(version, _answered(answers, request))


def _answered(answers: dict[tuple[str, int], PartitionAnswer], request: Any) -> Answered:
    by_topic: Answered = {}
    for topic in request.topic_data:
        name = str(topic.name)
        entry = by_topic.get(name)
        if entry is None:
            entry = by_topic[name] = (topic.name, {})
        partitions = entry[1]
        for part in topic.partition_data:
            index = int(part.index)
            if index not in partitions:
                partitions[index] = answers[(name, index)]
    return by_topic


def _response(version: int, answered: Answered) -> ResponsePayload:
    response_cls = response_type(ApiKey.PRODUCE, version)
    module = sys.modules[response_cls.__module__]
    endpoints: dict[int, Any] = {}
    topics = []
    for name, partitions in answered.values():
        responses = []
        for index, answer in partitions.items():
            # kio's phantom types (i32, i64) are their values at run time: the values come
            # from the decoded request and Kafka's answers, so they are cast, not validated.
            fields: dict[str, Any] = {
                "index": cast(i32, index),
                "error_code": error_code(answer.error_code),
                "base_offset": cast(i64, answer.base_offset),
            }
            if answer.log_append_time_ms >= 0:  # the topic's timestamps are Kafka's
                fields["log_append_time"] = _datetime(answer.log_append_time_ms)
            if version >= 5:
                fields["log_start_offset"] = cast(i64, answer.log_start_offset)
            if version >= 8:
                fields["record_errors"] = ()
                fields["error_message"] = answer.error_message
            if version >= 10 and answer.redirect is not None:
                # KIP-951: the client goes to the partition's owner without a metadata round.
                node = answer.redirect.node
                fields["current_leader"] = module.LeaderIdAndEpoch(
                    leader_id=BrokerId(node.node_id), leader_epoch=i32(answer.redirect.leader_epoch)
                )
                endpoints[node.node_id] = module.NodeEndpoint(
                    node_id=BrokerId(node.node_id),
                    host=node.endpoint.host,
                    port=i32(node.endpoint.port),
                    rack=None,
                )
            responses.append(module.PartitionProduceResponse(**fields))
        topics.append(module.TopicProduceResponse(name=name, partition_responses=tuple(responses)))
    if endpoints:
        response: ResponsePayload = response_cls(
            responses=tuple(topics),
            node_endpoints=tuple(endpoints[i] for i in sorted(endpoints)),
        )
    else:
        response = response_cls(responses=tuple(topics))
    return response


def _datetime(millis: int) -> datetime.datetime:
    """kio's value of a timestamp in milliseconds (it writes it back as the same number)."""
    return datetime.datetime.fromtimestamp(millis / 1000, tz=datetime.UTC)
