"""How the dedup filter decodes a Produce request: a large one in a worker thread by the
hand decoder, the same entity kio makes; a small one, or one the hand decoder leaves to
kio, by kio on the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dedup.produce_filter import DECODE_OFF_LOOP_BYTES, _decoded
from proxy.kafka.schemas import decode_request_body
from proxy.kafka.upstream_client import encode_request
from proxy.kafka.wire import FrameError, parse_request_header
from proxy.runtime.chain import RequestFrame
from tests.support.raw import produce_request
from tests.support.threads import record_to_thread

pytestmark = pytest.mark.unit


def frame_of(records: bytes, tail: bytes = b"") -> RequestFrame:
    request = produce_request("t", {0: records})
    payload = encode_request(request, 7)[4:]
    if tail:  # replace the body's empty tagged fields
        payload = payload[:-1] + tail
    return RequestFrame(parse_request_header(payload), payload)


def kio_decode(frame: RequestFrame) -> Any:
    header = frame.header
    return decode_request_body(0, header.api_version, frame.payload, header.body_offset)


def test_a_large_request_is_decoded_in_a_worker_thread_as_kio_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(bytes(range(256)) * (DECODE_OFF_LOOP_BYTES // 256))
    decoded = asyncio.run(_decoded(frame))
    assert len(ran_in) == 1 and ran_in[0] != threading.get_ident()
    assert decoded == kio_decode(frame)
    assert frame.decode() is decoded, "kept on the frame"


def test_a_small_request_is_decoded_by_kio_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    ran_in = record_to_thread(monkeypatch)
    frame = frame_of(b"abc")
    assert asyncio.run(_decoded(frame)) == kio_decode(frame)
    assert ran_in == []


def test_a_large_request_the_hand_decoder_leaves_is_kios_to_refuse() -> None:
    frame = frame_of(bytes(DECODE_OFF_LOOP_BYTES), tail=b"\x01\x05\x01\x00")  # a tagged field
    with pytest.raises(FrameError, match="malformed produce request"):
        asyncio.run(_decoded(frame))
