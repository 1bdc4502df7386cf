"""The response filter contract: one small class per API whose responses the proxy rewrites.

The runtime decodes a response only when a filter for its API wants it, hands the decoded
kio entity to the filter, and re-encodes what the filter returns. The response header is
kept verbatim. Everything else passes through byte-for-byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from proxy.kafka.topology import Topology


@dataclass(frozen=True, slots=True)
class FilterContext:
    topology: Topology


class ResponseFilter(Protocol):
    api_key: int

    def wants(self, version: int, payload: bytes, body_start: int, context: FilterContext) -> bool:
        """A cheap look at the raw response: does it need decoding at all?"""
        ...

    async def rewrite(self, version: int, response: Any, context: FilterContext) -> Any:
        """Return the response to send to the client (the same object if unchanged)."""
        ...
