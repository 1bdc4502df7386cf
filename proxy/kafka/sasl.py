"""SASL for the proxy's own connections to Kafka: PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER,
with the proxy's configured credentials (KIP-43 handshake, then KIP-152 SaslAuthenticate
frames). OAUTHBEARER's tokens come from `proxy.kafka.oauthbearer`.

Client connections never come through here: a client authenticates itself, through the
proxy, on its own upstream connection. SCRAM's client side is `scramp`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kio.schema.sasl_authenticate.v2.request import SaslAuthenticateRequest
from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest
from scramp import ScramClient, ScramException

from proxy.kafka.oauthbearer import (
    ERROR_ACKNOWLEDGEMENT,
    TokenSource,
    TokenUnavailable,
    initial_response,
)

SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]
MECHANISMS: tuple[SaslMechanism, ...] = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


class SaslFailed(ConnectionError):
    """Kafka refused the proxy's credentials or mechanism; the message says which."""


@dataclass(frozen=True, slots=True)
class SaslCredentials:
    mechanism: SaslMechanism
    username: str
    password: str = field(repr=False)

    def librdkafka(self) -> dict[str, Any]:
        return {
            "sasl.mechanism": self.mechanism,
            "sasl.username": self.username,
            "sasl.password": self.password,
        }

    def describe(self) -> str:
        return f"user {self.username!r}"


@dataclass(frozen=True, slots=True)
class OAuthBearerCredentials:
    """OAUTHBEARER: a bearer token from ``tokens`` at every authentication."""

    tokens: TokenSource
    mechanism: SaslMechanism = "OAUTHBEARER"

    def librdkafka(self) -> dict[str, Any]:
        return {"sasl.mechanism": "OAUTHBEARER", **self.tokens.librdkafka()}

    def describe(self) -> str:
        return self.tokens.describe()


Credentials = SaslCredentials | OAuthBearerCredentials
Request = Callable[[Any], Awaitable[Any]]


async def authenticate(request: Request, credentials: Credentials, peer: str) -> None:
    """Run the SASL exchange on a fresh connection (``request`` sends one kio request and
    returns its decoded answer); `SaslFailed` if Kafka says no or no token can be had."""
    handshake = await request(SaslHandshakeRequest(mechanism=credentials.mechanism))
    if handshake.error_code != 0:
        enabled = ", ".join(str(m) for m in handshake.mechanisms) or "none"
        raise SaslFailed(
            f"{peer} does not accept SASL {credentials.mechanism} (enabled: {enabled})"
        )

    async def exchange(data: bytes) -> bytes:
        answer = await request(SaslAuthenticateRequest(auth_bytes=data))
        if answer.error_code != 0:
            reason = answer.error_message or f"error {int(answer.error_code)}"
            raise SaslFailed(
                f"{peer} refused {credentials.describe()} ({credentials.mechanism}): {reason}"
            )
        return bytes(answer.auth_bytes)

    if isinstance(credentials, OAuthBearerCredentials):
        try:
            token = await asyncio.to_thread(credentials.tokens.token)
        except TokenUnavailable as exc:
            raise SaslFailed(f"no bearer token for {peer}: {exc}") from None
        challenge = await exchange(initial_response(token.value))
        if challenge:  # RFC 7628 3.2.2: an error, as JSON; acknowledge it, Kafka then refuses
            await exchange(ERROR_ACKNOWLEDGEMENT)
            raise SaslFailed(  # reached only if Kafka did not refuse after all
                f"{peer} refused {credentials.describe()} (OAUTHBEARER): "
                f"{challenge.decode(errors='replace')}"
            )
        return
    if credentials.mechanism == "PLAIN":
        await exchange(
            b"\0" + credentials.username.encode() + b"\0" + credentials.password.encode()
        )
        return
    scram = ScramClient([credentials.mechanism], credentials.username, credentials.password)
    try:
        server_first = await exchange(scram.get_client_first().encode())
        scram.set_server_first(server_first.decode())
        server_final = await exchange(scram.get_client_final().encode())
        scram.set_server_final(server_final.decode())  # checks the server knew the password
    except ScramException as exc:
        raise SaslFailed(f"{peer}: SCRAM exchange failed: {exc}") from None
