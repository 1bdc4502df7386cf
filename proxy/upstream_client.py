"""The proxy's own requests to an upstream broker (metadata refresh), encoded with kio.

Only what the proxy itself asks goes through here; client traffic never does. One
request at a time per connection keeps the correlation trivially right.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from typing import Any, cast

from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse
from kio.serial import entity_writer
from kio.static.primitive import i32

from proxy.schemas import decode_response_body, encode_body, response_header_is_flexible
from proxy.topology import Endpoint
from proxy.wire import correlation_id_of, read_frame, response_body_start

CLIENT_ID = "dedup-proxy"
_MAX_RESPONSE_BYTES = 1 << 30


class UpstreamClient:
    def __init__(self, endpoint: Endpoint, timeout_s: float) -> None:
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._correlation = itertools.count(1)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> UpstreamClient:
        self._streams = await asyncio.wait_for(
            asyncio.open_connection(self.endpoint.host, self.endpoint.port), self._timeout_s
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def request(self, payload: Any) -> Any:
        if self._streams is None:
            raise RuntimeError("not connected")
        reader, writer = self._streams
        correlation_id = next(self._correlation)
        async with self._lock:
            writer.write(encode_request(payload, correlation_id))
            await writer.drain()
            answer = await asyncio.wait_for(
                read_frame(reader, _MAX_RESPONSE_BYTES), self._timeout_s
            )
        if answer is None:
            raise ConnectionError(f"{self.endpoint} closed the connection")
        if correlation_id_of(answer) != correlation_id:
            raise ConnectionError(f"{self.endpoint} answered another request")
        api_key, version = int(payload.__api_key__), int(payload.__version__)
        body_start = response_body_start(answer, response_header_is_flexible(api_key, version))
        return decode_response_body(api_key, version, answer, body_start)


def encode_request(payload: Any, correlation_id: int, client_id: str = CLIENT_ID) -> bytes:
    """A whole request frame (size, header, body) for a kio request entity."""
    header_type = payload.__header_schema__
    header = header_type(
        request_api_key=payload.__api_key__,
        request_api_version=payload.__version__,
        correlation_id=i32(correlation_id),
        client_id=client_id,
    )
    buffer = io.BytesIO()
    entity_writer(header_type)(buffer, header)
    message = buffer.getvalue() + encode_body(payload)
    return len(message).to_bytes(4, "big") + message


async def fetch_brokers(endpoint: Endpoint, timeout_s: float) -> list[tuple[int, str, int]]:
    """The brokers of the cluster as one broker reports them (a Metadata request, no topics)."""
    request = MetadataRequest(
        topics=(),
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=False,
    )
    async with UpstreamClient(endpoint, timeout_s) as client:
        response = cast(MetadataResponse, await client.request(request))
    return [(int(b.node_id), b.host, int(b.port)) for b in response.brokers]
