"""Produce requests through the dedup engine: the one request the proxy answers itself.

A Produce request whose topics have dedup enabled is decoded, run through the engine
(check, rebuild, idempotent write), and answered by the proxy in the client's version.
Anything else (transactional, dedup disabled everywhere it writes) is forwarded as is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from dedup.engine import Admission, DedupEngine, produce_response
from proxy.kafka.schemas import decode_request_body, encode_body, response_header_is_flexible
from proxy.kafka.topology import Endpoint
from proxy.kafka.wire import FrameError, RequestHeader

log = structlog.get_logger(__name__)


class DedupProduceHandler:
    def __init__(self, engine: DedupEngine) -> None:
        self._engine = engine
        self._running: set[asyncio.Task[bytes]] = set()

    async def take(
        self, header: RequestHeader, payload: bytes, broker: Endpoint
    ) -> asyncio.Future[bytes] | None:
        """None: forward the request unchanged. Else the future of the answer payload."""
        if not await self._engine.dedup_anywhere():
            return None
        try:
            request = decode_request_body(0, header.api_version, payload, header.body_offset)
        except Exception as exc:
            raise FrameError(f"malformed produce request: {exc}") from exc
        admission = await self._engine.admit(request)
        if admission is None:
            return None
        # The write runs to its end even if the client goes away (its connection's tasks are
        # cancelled): the writer's sequences and the dedup state must not stop half-way.
        task = asyncio.create_task(self._answer(header, request, admission, broker))
        self._running.add(task)
        task.add_done_callback(self._finished)
        return asyncio.shield(task)

    def _finished(self, task: asyncio.Task[bytes]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("produce through dedup failed", error=repr(task.exception()))

    async def _answer(
        self, header: RequestHeader, request: Any, admission: Admission, broker: Endpoint
    ) -> bytes:
        answers = await self._engine.produce(request, admission, broker)
        response = produce_response(header.api_version, answers, request)
        correlation = header.correlation_id.to_bytes(4, "big", signed=True)
        tagged = b"\x00" if response_header_is_flexible(0, header.api_version) else b""
        return correlation + tagged + encode_body(response)

    async def drain(self) -> None:
        """Wait for every write already taken (graceful shutdown)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
