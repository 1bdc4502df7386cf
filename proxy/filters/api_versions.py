"""ApiVersions: advertise only what both the upstream broker and the proxy can speak, and
answer a request newer than the proxy knows with Kafka's version-negotiation error. The
client's name and version (KIP-511, v3 and later) are kept for the connection's filters.

A client negotiates every later request from this answer, so capping each API at the
versions kio can decode guarantees that every response the proxy must rewrite is one it
can read. APIs unknown to the proxy are left out altogether.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import kio.schema.api_versions.v0.response as api_versions_v0
from kio.schema.errors import ErrorCode
from kio.static.primitive import i16
from kio.static.protocol import ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.schemas import DECODABLE_VERSIONS, VersionRange
from proxy.runtime.chain import FilterContext, Forward, RequestDecision, RequestFrame, Respond

_ERROR_CODE = struct.Struct(">h")


class ApiVersionsFilter:
    request_keys = frozenset({ApiKey.API_VERSIONS})
    response_keys = frozenset({ApiKey.API_VERSIONS})

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        # A client newer than the proxy: answer as Kafka does, with the range to retry in.
        if frame.header.api_version > DECODABLE_VERSIONS[ApiKey.API_VERSIONS].max:
            return Respond.now(unsupported_api_versions_response())
        if frame.header.api_version >= 3:
            request: Any = frame.decode()
            context.software.name = str(request.client_software_name)
            context.software.version = str(request.client_software_version)
        return Forward()

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        # An error answer is encoded as v0 whatever the request's version; the client
        # retries with a version the proxy accepts, so it passes through as it is.
        (error_code,) = _ERROR_CODE.unpack_from(payload, body_start)
        return bool(error_code == 0)

    async def on_response(
        self, version: int, payload_entity: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        response: Any = payload_entity  # one kio class per version, the same fields
        kept = []
        for entry in response.api_keys:
            ours = DECODABLE_VERSIONS.get(int(entry.api_key))
            if ours is None:
                continue
            both = ours.intersect(VersionRange(int(entry.min_version), int(entry.max_version)))
            if both is not None:
                kept.append(replace(entry, min_version=i16(both.min), max_version=i16(both.max)))
        rewritten: ResponsePayload = replace(response, api_keys=tuple(kept))
        return rewritten


def unsupported_api_versions_response() -> api_versions_v0.ApiVersionsResponse:
    """Kafka's answer to an ApiVersions request newer than it knows: error plus its range.

    It is always encoded as v0 so that the client can read it and retry at a version the
    proxy supports.
    """
    ours = DECODABLE_VERSIONS[ApiKey.API_VERSIONS]
    return api_versions_v0.ApiVersionsResponse(
        error_code=ErrorCode.unsupported_version,
        api_keys=(
            api_versions_v0.ApiVersion(
                api_key=i16(ApiKey.API_VERSIONS),
                min_version=i16(ours.min),
                max_version=i16(ours.max),
            ),
        ),
    )
