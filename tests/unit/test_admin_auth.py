"""Admin API tokens: how they are read, which scope each request needs, and that a bad
configuration is refused without showing the token."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.runtime.admin_auth import Scope, TokenError, load_admin_tokens, needed_scope
from proxy.runtime.settings import ConfigError, ProxySettings, load_settings

pytestmark = pytest.mark.unit

A = "a" * 16
R = "r" * 20


def test_tokens_from_the_file_and_the_setting_both_count(tmp_path: Path) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"# comment\n\nadmin {A}\n")
    tokens = load_admin_tokens(file, f"read:{R}, admin:{'b' * 16}")
    assert tokens is not None
    assert tokens.scope_of(A) is Scope.ADMIN
    assert tokens.scope_of(R) is Scope.READ
    assert tokens.scope_of("b" * 16) is Scope.ADMIN
    assert tokens.scope_of("x" * 16) is None
    assert tokens.scope_of("") is None
    assert load_admin_tokens(None, None) is None
    assert load_admin_tokens(None, " , ") is None


@pytest.mark.parametrize(
    ("inline", "message"),
    [
        (f"write:{A}", "scope must be read or admin, not 'write'"),
        ("admin:short-secret", "at least 16 characters"),
        (f"admin:{A} {A}", "no spaces"),
    ],
)
def test_a_bad_token_setting_is_refused_without_showing_the_token(
    inline: str, message: str
) -> None:
    with pytest.raises(TokenError, match=message) as refused:
        load_admin_tokens(None, inline)
    assert "short-secret" not in str(refused.value) and A not in str(refused.value)
    with pytest.raises(ConfigError, match="admin_tokens"):
        load_settings(ProxySettings, admin_tokens=inline)


def test_a_missing_tokens_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin_tokens_file"):
        load_settings(ProxySettings, admin_tokens_file=tmp_path / "missing")


@pytest.mark.parametrize(
    ("method", "path", "needed"),
    [
        ("GET", "/healthz", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/policies", Scope.READ),
        ("GET", "/v1/topics/t/producers/p", Scope.READ),
        ("POST", "/v1/producer-names", Scope.READ),
        ("PUT", "/v1/policies/global", Scope.ADMIN),
        ("DELETE", "/v1/policies/topics/t", Scope.ADMIN),
        ("POST", "/v1/topics/t/partitions/0/recover", Scope.ADMIN),
        ("POST", "/v1/topics/t/partitions/0/snapshot", Scope.ADMIN),
    ],
)
def test_what_each_request_needs(method: str, path: str, needed: Scope | None) -> None:
    assert needed_scope(method, path) is needed
