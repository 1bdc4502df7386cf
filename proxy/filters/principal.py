"""Who the client is: the principal a client proves to Kafka through the proxy, read off
its own SASL exchange (relayed untouched), for filters that act on it (producer names
bound to principals, `dedup.bindings`).

SASL PLAIN names the user in its one message; SCRAM in its first (``n,,n=USER,r=...``);
OAUTHBEARER in its token's ``sub`` claim (Kafka's default principal claim). The principal
is set only once Kafka accepted the exchange: after PLAIN's and OAUTHBEARER's one round
(an OAUTHBEARER answer that carries bytes is Kafka's error, RFC 7628 3.2.2), after SCRAM's
second. GSSAPI leaves it unknown. A client certificate's principal is set when the
connection opens (`proxy.runtime.connection`).
"""

from __future__ import annotations

from typing import Any

from kio.static.protocol import ResponsePayload

from proxy.kafka.api_keys import ApiKey
from proxy.kafka.oauthbearer import client_principal
from proxy.runtime.chain import FilterContext, Forward, RequestDecision, RequestFrame

_ROUNDS = {"PLAIN": 1, "SCRAM-SHA-256": 2, "SCRAM-SHA-512": 2, "OAUTHBEARER": 1}


class SaslPrincipalFilter:
    request_keys = frozenset({ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})
    response_keys = frozenset({ApiKey.SASL_AUTHENTICATE})

    async def on_request(self, frame: RequestFrame, context: FilterContext) -> RequestDecision:
        identity = context.identity
        request: Any = frame.decode()
        if frame.header.api_key == ApiKey.SASL_HANDSHAKE:
            identity.mechanism, identity.user, identity.rounds = str(request.mechanism), None, 0
        elif identity.user is None and identity.mechanism in _ROUNDS:
            identity.user = sasl_user(identity.mechanism, bytes(request.auth_bytes))
        return Forward()

    def wants_response(
        self, version: int, payload: bytes, body_start: int, context: FilterContext
    ) -> bool:
        return context.identity.user is not None

    async def on_response(
        self, version: int, response: ResponsePayload, context: FilterContext
    ) -> ResponsePayload:
        identity = context.identity
        answer: Any = response
        if answer.error_code != 0 or (identity.mechanism == "OAUTHBEARER" and answer.auth_bytes):
            identity.user = None  # Kafka said no (and closes the connection)
            return response
        identity.rounds += 1
        if identity.user is not None and identity.rounds == _ROUNDS.get(identity.mechanism or ""):
            identity.principal = f"User:{identity.user}"
        return response


def sasl_user(mechanism: str, message: bytes) -> str | None:
    """The user a client's first SASL message names (None if it names none)."""
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if mechanism == "OAUTHBEARER":
        return client_principal(message)
    if mechanism == "PLAIN":  # [authzid] NUL authcid NUL password
        parts = text.split("\0")
        return parts[1] or None if len(parts) == 3 else None
    # SCRAM client-first: gs2-header "n,," (or "y,,", "n,a=..,") then "n=USER,r=NONCE"
    for attribute in text.split(",")[2:]:
        if attribute.startswith("n="):
            user = attribute[2:].replace("=2C", ",").replace("=3D", "=")
            return user or None
    return None
