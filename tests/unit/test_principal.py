"""Reading who a client is off its own SASL exchange (`proxy.filters.principal`), with
hypothesis for the SCRAM name escaping; an OAUTHBEARER exchange through the filter.
(End to end: tests/integration/test_tls.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.tls import unsigned_token
from proxy.filters.principal import SaslPrincipalFilter, sasl_user
from proxy.kafka.api_keys import ApiKey
from proxy.kafka.oauthbearer import initial_response
from proxy.kafka.topology import Endpoint, Topology
from proxy.runtime.chain import ClientIdentity, FilterContext

pytestmark = pytest.mark.unit


def test_plain_names_the_authentication_id() -> None:
    assert sasl_user("PLAIN", b"\0alice\0secret") == "alice"
    assert sasl_user("PLAIN", b"admin\0alice\0secret") == "alice"  # authzid is not the user
    assert sasl_user("PLAIN", b"\0\0secret") is None
    assert sasl_user("PLAIN", b"alice secret") is None
    assert sasl_user("PLAIN", b"\xff\0alice\0x") is None  # not UTF-8


def test_scram_client_first_names_the_user() -> None:
    assert sasl_user("SCRAM-SHA-256", b"n,,n=alice,r=abc") == "alice"
    assert sasl_user("SCRAM-SHA-512", b"n,a=ops,n=bob,r=xyz") == "bob"
    assert sasl_user("SCRAM-SHA-256", b"n,,r=abc") is None
    assert sasl_user("SCRAM-SHA-256", b"garbage") is None


@given(st.text(min_size=1).filter(lambda text: "\0" not in text))
def test_a_scram_name_survives_its_escaping(user: str) -> None:
    escaped = user.replace("=", "=3D").replace(",", "=2C")
    assert sasl_user("SCRAM-SHA-256", f"n,,n={escaped},r=nonce".encode()) == user


@dataclass
class Frame:
    """The two things the filter reads off a request frame."""

    api_key: ApiKey
    body: Any

    @property
    def header(self) -> Any:
        return SimpleNamespace(api_key=self.api_key)

    def decode(self) -> Any:
        return self.body


async def exchange(messages: list[bytes], answers: list[tuple[int, bytes]]) -> ClientIdentity:
    """An OAUTHBEARER exchange through the filter; the identity it leaves."""
    filter_ = SaslPrincipalFilter()
    context = FilterContext(Topology([Endpoint("kafka", 9092)], "proxy", broker_port_base=40000))
    await filter_.on_request(
        Frame(ApiKey.SASL_HANDSHAKE, SimpleNamespace(mechanism="OAUTHBEARER")),  # type: ignore[arg-type]
        context,
    )
    for message, (error, auth_bytes) in zip(messages, answers, strict=True):
        request = SimpleNamespace(auth_bytes=message)
        await filter_.on_request(Frame(ApiKey.SASL_AUTHENTICATE, request), context)  # type: ignore[arg-type]
        answer = SimpleNamespace(error_code=error, auth_bytes=auth_bytes)
        await filter_.on_response(2, answer, context)  # type: ignore[arg-type]
    return context.identity


async def test_an_accepted_bearer_token_gives_its_subject() -> None:
    identity = await exchange([initial_response(unsigned_token("orders-app"))], [(0, b"")])
    assert identity.principal == "User:orders-app"


async def test_a_bearer_token_kafka_refuses_gives_nobody() -> None:
    # Kafka's refusal: an error challenge with no error code, then the error after the
    # client's acknowledgement (RFC 7628 3.2.2).
    identity = await exchange(
        [initial_response(unsigned_token("mallory")), b"\x01"],
        [(0, b'{"status":"invalid_token"}'), (58, b"")],
    )
    assert identity.principal is None
