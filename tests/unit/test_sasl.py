"""The proxy's own SASL exchange (`proxy.kafka.sasl`) against a broker played in memory:
PLAIN's bytes, SCRAM against scramp's server side (a wrong password fails on either side),
and Kafka's refusals turned into errors that name the mechanism or the user.
(End to end against Kafka's SASL_SSL listeners: tests/integration/test_tls.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from scramp import ScramMechanism

from proxy.kafka.sasl import SaslCredentials, SaslFailed, authenticate

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
