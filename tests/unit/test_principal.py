"""Reading who a client is off its own SASL exchange (`proxy.filters.principal`), with
hypothesis for the SCRAM name escaping. (End to end: tests/integration/test_tls.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.filters.principal import sasl_user

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
