"""The proxy's own SASL exchange (`proxy.kafka.sasl`) against a broker played in memory:
PLAIN's bytes, SCRAM against scramp's server side (a wrong password fails on either side),
OAUTHBEARER's token and its error challenge, and Kafka's refusals turned into errors that
name the mechanism or the user.
(End to end against Kafka's SASL_SSL listeners: tests/integration/test_tls.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from scramp import ScramMechanism

from deploy.tls import unsigned_token
from proxy.kafka.oauthbearer import TokenFile, client_token, initial_response
from proxy.kafka.sasl import OAuthBearerCredentials, SaslCredentials, SaslFailed, authenticate

pytestmark = pytest.mark.unit


@dataclass
class Answer:
    error_code: ErrorCode = ErrorCode.none
    error_message: str | None = None
    auth_bytes: bytes = b""
    mechanisms: tuple[str, ...] = ()


@dataclass
class Broker:
    """Answers SaslHandshake and SaslAuthenticate like Kafka, for one mechanism."""

    mechanism: str
    users: dict[str, str]
    seen: list[bytes] = field(default_factory=list)
    _scram: Any = None

    async def request(self, payload: Any) -> Answer:
        if type(payload).__name__ == "SaslHandshakeRequest":
            if payload.mechanism != self.mechanism:
                return Answer(ErrorCode.unsupported_sasl_mechanism, mechanisms=(self.mechanism,))
            return Answer()
        data = bytes(payload.auth_bytes)
        self.seen.append(data)
        if self.mechanism == "PLAIN":
            _, user, password = data.split(b"\0")
            if self.users.get(user.decode()) != password.decode():
                return Answer(ErrorCode.sasl_authentication_failed, "Invalid username or password")
            return Answer()
        return self._scram_step(data.decode())

    def _scram_step(self, message: str) -> Answer:
        if self._scram is None:
            mechanism = ScramMechanism(self.mechanism)
            stored = {
                user: mechanism.make_auth_info(password, iteration_count=4096)
                for user, password in self.users.items()
            }
            self._scram = mechanism.make_server(lambda user: stored[user])
            self._scram.set_client_first(message)
            return Answer(auth_bytes=self._scram.get_server_first().encode())
        try:
            self._scram.set_client_final(message)
        except Exception:
            return Answer(ErrorCode.sasl_authentication_failed, "Authentication failed")
        return Answer(auth_bytes=self._scram.get_server_final().encode())


async def test_plain_sends_user_and_password_once() -> None:
    broker = Broker("PLAIN", {"proxy": "pw"})
    await authenticate(broker.request, SaslCredentials("PLAIN", "proxy", "pw"), "b:1")
    assert broker.seen == [b"\0proxy\0pw"]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_scram_completes_and_checks_the_server(mechanism: str) -> None:
    broker = Broker(mechanism, {"proxy": "pw"})
    await authenticate(broker.request, SaslCredentials(mechanism, "proxy", "pw"), "b:1")  # type: ignore[arg-type]
    assert len(broker.seen) == 2 and broker.seen[0].startswith(b"n,,n=proxy,r=")


async def test_a_wrong_scram_password_is_refused_naming_the_user() -> None:
    broker = Broker("SCRAM-SHA-256", {"proxy": "pw"})
    with pytest.raises(SaslFailed, match="refused user 'proxy' \\(SCRAM-SHA-256\\)"):
        await authenticate(
            broker.request, SaslCredentials("SCRAM-SHA-256", "proxy", "wrong"), "b:1"
        )


async def test_a_wrong_plain_password_is_refused_with_kafkas_message() -> None:
    broker = Broker("PLAIN", {"proxy": "pw"})
    with pytest.raises(SaslFailed, match="Invalid username or password"):
        await authenticate(broker.request, SaslCredentials("PLAIN", "proxy", "x"), "b:1")


async def test_a_mechanism_kafka_does_not_enable_names_the_ones_it_does() -> None:
    broker = Broker("SCRAM-SHA-512", {})
    with pytest.raises(SaslFailed, match="does not accept SASL PLAIN \\(enabled: SCRAM-SHA-512\\)"):
        await authenticate(broker.request, SaslCredentials("PLAIN", "proxy", "pw"), "b:1")


def test_credentials_never_show_the_password() -> None:
    credentials = SaslCredentials("PLAIN", "proxy", "secret-pw")
    assert "secret-pw" not in repr(credentials)
    assert credentials.librdkafka()["sasl.password"] == "secret-pw"


class BearerBroker:
    """Answers OAUTHBEARER like Kafka: an empty answer accepts; a token it refuses gets an
    error challenge, and the client's acknowledgement the refusal."""

    def __init__(self, accepted: str) -> None:
        self.accepted = accepted
        self.seen: list[bytes] = []

    async def request(self, payload: Any) -> Answer:
        if type(payload).__name__ == "SaslHandshakeRequest":
            return Answer()
        data = bytes(payload.auth_bytes)
        self.seen.append(data)
        if data == b"\x01":
            return Answer(ErrorCode.sasl_authentication_failed, "invalid_token")
        if client_token(data) == self.accepted:
            return Answer()
        return Answer(auth_bytes=b'{"status":"invalid_token"}')


async def test_oauthbearer_sends_the_token_of_its_source(tmp_path: Path) -> None:
    token = unsigned_token("proxy")
    (tmp_path / "token").write_text(token)
    broker = BearerBroker(token)
    await authenticate(broker.request, OAuthBearerCredentials(TokenFile(tmp_path / "token")), "b:1")
    assert broker.seen == [initial_response(token)]


async def test_a_refused_token_is_acknowledged_then_named(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(unsigned_token("proxy"))
    broker = BearerBroker("another")
    credentials = OAuthBearerCredentials(TokenFile(tmp_path / "token"))
    with pytest.raises(SaslFailed, match=r"refused the token in .*token \(OAUTHBEARER\)"):
        await authenticate(broker.request, credentials, "b:1")
    assert broker.seen[1:] == [b"\x01"]


async def test_no_token_is_a_sasl_failure(tmp_path: Path) -> None:
    credentials = OAuthBearerCredentials(TokenFile(tmp_path / "missing"))
    with pytest.raises(SaslFailed, match="no bearer token for b:1"):
        await authenticate(BearerBroker("x").request, credentials, "b:1")
