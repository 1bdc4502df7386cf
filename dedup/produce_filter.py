"""Produce requests through the dedup engine: the one request the proxy answers itself.

A request filter (`proxy.runtime.chain`). A Produce request whose topics have dedup
enabled is decoded, run through the engine (check, rebuild, idempotent write), and
answered by the proxy in the client's version. Anything else (transactional, dedup
disabled everywhere it writes) is forwarded as it is, undecoded where no policy can
enable dedup at all.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from typing import Any, cast

import structlog
from kio.schema.types import BrokerId
from kio.static.primitive import i32, i64
from kio.static.protocol import ResponsePayload

from dedup.batches import copy_of
from dedup.engine import Admission, DedupEngine, PartitionAnswer
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.error_codes import error_code
from proxy.kafka.produce_decoder import decode_produce_request
from proxy.kafka.schemas import response_type
from proxy.kafka.topology import Endpoint
from proxy.runtime.chain import FilterContext, Forward, RequestDecision, RequestFrame, Respond

log = structlog.get_logger(__name__)

# A Produce request of this size or more is decoded off the event loop: kio decodes on it,
# and copies the records while it does (some 17 ms for 32 MB, every other connection held).
DECODE_OFF_LOOP_BYTES = 1 << 20


class DedupProduceFilter:
    request_keys = frozenset({ApiKey.PRODUCE})

    def __init__(self, engine: DedupEngine) -> None:
        self._engine = engine
        self._running: set[asyncio.Task[ResponsePayload]] = set()

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        if not await self._engine.dedup_anywhere():
            return Forward()
        request: Any = await _decoded(frame)  # one kio class per version, the same fields
        admission = await self._engine.admit(
            request, context.identity.principal, context.connection
        )
        if admission is None:
            return Forward()
        assert context.upstream is not None, "a request arrives only once upstream is connected"
        # The write runs to its end even if the client goes away (its connection's tasks are
        # cancelled): the writer's sequences and the dedup state must not stop half-way.
        task = asyncio.create_task(
            self._answer(frame.header.api_version, request, admission, context.upstream)
        )
        self._running.add(task)
        # The connection waits on its own future, which the task's end settles (what
        # asyncio.shield does, in fewer steps): cancelling the wait leaves the task running.
        answer: asyncio.Future[ResponsePayload] = asyncio.get_running_loop().create_future()
        task.add_done_callback(functools.partial(self._finished, answer))
        return Respond(answer)

    def _finished(
        self, answer: asyncio.Future[ResponsePayload], task: asyncio.Task[ResponsePayload]
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
        self, version: int, request: Any, admission: Admission, broker: Endpoint
    ) -> ResponsePayload:
        answers = await self._engine.produce(request, admission, broker)
        return produce_response(version, answers, request)

    async def drain(self) -> None:
        """Wait for every write already taken (graceful shutdown)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


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


def produce_response(
    version: int, answers: dict[tuple[str, int], PartitionAnswer], request: Any
) -> ResponsePayload:
    """The kio ProduceResponse of the client's version, partitions in request order.

    A partition named twice gets one entry, as from Kafka's broker (which keeps one entry
    per partition), and so does a topic named twice.
    """
    response_cls = response_type(ApiKey.PRODUCE, version)
    module = sys.modules[response_cls.__module__]
    by_topic: dict[str, dict[int, Any]] = {}
    names: dict[str, Any] = {}
    endpoints: dict[int, Any] = {}
    for topic in request.topic_data:
        name = str(topic.name)
        names.setdefault(name, topic.name)
        partitions = by_topic.setdefault(name, {})
        for part in topic.partition_data:
            index = int(part.index)
            if index in partitions:
                continue
            answer = answers[(name, index)]
            # kio's phantom types (i32, i64) are their values at run time: the values come
            # from the decoded request and Kafka's answers, so they are cast, not validated.
            fields: dict[str, Any] = {
                "index": cast(i32, index),
                "error_code": error_code(answer.error_code),
                "base_offset": cast(i64, answer.base_offset),
            }
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
            partitions[index] = module.PartitionProduceResponse(**fields)
    topics = tuple(
        module.TopicProduceResponse(
            name=names[name], partition_responses=tuple(partitions.values())
        )
        for name, partitions in by_topic.items()
    )
    if endpoints:
        response: ResponsePayload = response_cls(
            responses=topics, node_endpoints=tuple(endpoints[i] for i in sorted(endpoints))
        )
    else:
        response = response_cls(responses=topics)
    return response
