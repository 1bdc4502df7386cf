"""OAUTHBEARER (`proxy.kafka.oauthbearer`): the messages of the exchange, with hypothesis
for reading a client's token back from any initial response; the principal a token names;
the proxy's token from a file and from a token endpoint served here on a real socket
(client credentials, caching, refusals). (End to end against Kafka: tests/integration/
test_tls.py.)"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.tls import unsigned_token
from proxy.kafka.oauthbearer import (
    BearerToken,
    TokenEndpoint,
    TokenFile,
    TokenUnavailable,
    client_principal,
    client_token,
    initial_response,
    librdkafka_callback,
    token_claims,
)
from tests.support.oauth import Issuer, token_endpoint

pytestmark = pytest.mark.unit

TOKEN_CHARS = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=200
)


@given(TOKEN_CHARS)
def test_a_token_is_read_back_from_the_initial_response(token: str) -> None:
    assert client_token(initial_response(token)) == token


@given(st.binary(max_size=300))
def test_any_bytes_give_a_token_or_none_never_an_error(message: bytes) -> None:
    found = client_token(message)
    assert found is None or isinstance(found, str)
    assert client_principal(message) is None or isinstance(client_principal(message), str)


def test_the_principal_is_the_tokens_sub_claim() -> None:
    assert client_principal(initial_response(unsigned_token("orders-app"))) == "orders-app"
    # An authzid in the GS2 header and extensions beside auth= change nothing.
    token = unsigned_token("bob")
    message = f"n,a=bob,\x01host=kafka\x01auth=Bearer {token}\x01traceId=1\x01\x01".encode()
    assert client_principal(message) == "bob"


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"\x01",  # a client's answer to an error challenge
        b"n,,\x01auth=Basic abc\x01\x01",
        b"n,,\x01auth=Bearer not-a-jwt\x01\x01",
        b"p=tls-unique,,\x01auth=Bearer a.b.c\x01\x01",
        initial_response("e30." + base64.urlsafe_b64encode(b'{"sub": 7}').decode() + "."),
        initial_response("e30." + base64.urlsafe_b64encode(b"[1]").decode() + "."),
    ],
)
def test_messages_that_name_no_principal(message: bytes) -> None:
    assert client_principal(message) is None


def test_a_token_without_expiry_lives_a_minute_and_one_with_it_until_then() -> None:
    now = time.time()
    opaque = BearerToken.parse("opaque-token", now)
    assert opaque.expires_at == pytest.approx(now + 60) and opaque.principal == ""
    jwt = BearerToken.parse(unsigned_token("svc", lifetime_s=600), now)
    assert jwt.expires_at == pytest.approx(now + 600, abs=2) and jwt.principal == "svc"
    assert token_claims(jwt.value)["sub"] == "svc"  # type: ignore[index]
    assert "eyJ" not in repr(jwt)  # the token itself is a secret


def test_a_token_file_is_read_at_every_ask(tmp_path: Path) -> None:
    path = tmp_path / "token"
    source = TokenFile(path)
    with pytest.raises(TokenUnavailable, match="token"):
        source.token()
    path.write_text(unsigned_token("first") + "\n")
    assert source.token().principal == "first"
    path.write_text(unsigned_token("renewed"))
    assert source.token().principal == "renewed"
    path.write_text("  \n")
    with pytest.raises(TokenUnavailable, match="is empty"):
        source.token()


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with token_endpoint(Issuer("proxy", "s3cret&=", subject="proxy")) as served:
        yield served


def test_the_token_endpoint_grants_client_credentials_and_is_asked_once(issuer: Issuer) -> None:
    source = TokenEndpoint(issuer.url, "proxy", "s3cret&=", scope="kafka")
    first, second = source.token(), source.token()
    assert first is second and first.principal == "proxy"
    assert issuer.asked == [{"grant_type": ["client_credentials"], "scope": ["kafka"]}]
    assert "s3cret" not in repr(source)


def test_a_token_is_renewed_once_most_of_its_life_is_over(issuer: Issuer) -> None:
    issuer.lifetime_s = 1
    source = TokenEndpoint(issuer.url, "proxy", "s3cret&=")
    source.token()
    time.sleep(1.1)
    source.token()
    assert len(issuer.asked) == 2


def test_a_refused_client_is_named(issuer: Issuer) -> None:
    with pytest.raises(TokenUnavailable, match="refused client 'proxy': HTTP 401"):
        TokenEndpoint(issuer.url, "proxy", "wrong").token()
    assert issuer.refused == 1


def test_an_unreachable_or_odd_endpoint_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not an http"):
        TokenEndpoint("file:///etc/passwd", "proxy", "x")
    with pytest.raises(TokenUnavailable, match=r"token endpoint http://127\.0\.0\.1:9/"):
        TokenEndpoint("http://127.0.0.1:9/", "proxy", "x", timeout_s=2).token()


def test_librdkafka_gets_the_same_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(unsigned_token("proxy", lifetime_s=120))
    value, expires_at, principal = librdkafka_callback(TokenFile(path))("")
    assert value == path.read_text() and principal == "proxy"
    assert expires_at == pytest.approx(time.time() + 120, abs=2)


def test_librdkafka_asks_the_same_endpoint_itself() -> None:
    source = TokenEndpoint("https://idp.example/token", "proxy", "pw", scope="kafka")
    assert source.librdkafka() == {
        "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token",
        "sasl.oauthbearer.client.id": "proxy",
        "sasl.oauthbearer.client.secret": "pw",
        "sasl.oauthbearer.scope": "kafka",
    }
