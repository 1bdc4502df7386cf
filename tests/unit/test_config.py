"""Configuration precedence (flags > environment > file > defaults); errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dedup.app.settings import load_settings
from proxy.runtime.settings import ConfigError

pytestmark = pytest.mark.unit


def test_defaults_derive_broker_ports_and_advertised_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DEDUP_PROXY_LISTEN", "DEDUP_PROXY_UPSTREAM", "DEDUP_PROXY_ADVERTISED_HOST"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(None, listen="0.0.0.0:9192")
    assert settings.effective_broker_port_base == 9193
    assert settings.effective_advertised_host == "127.0.0.1"


def test_flags_override_environment_which_overrides_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        'upstream = ["file-kafka:9092"]\nlisten = "127.0.0.1:7000"\nadmin = "127.0.0.1:7100"\n'
    )
    monkeypatch.setenv("DEDUP_PROXY_UPSTREAM", "env-a:9092, env-b:9093")
    monkeypatch.setenv("DEDUP_PROXY_ADMIN", "127.0.0.1:7200")
    settings = load_settings(config, admin="127.0.0.1:7300")
    assert settings.upstream == ["env-a:9092", "env-b:9093"]
    assert settings.listen == "127.0.0.1:7000"
    assert settings.admin == "127.0.0.1:7300"


def test_errors_name_the_bad_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="listen"):
        load_settings(None, listen="no-port-here")
    with pytest.raises(ConfigError, match="max_frame_bytes"):
        load_settings(None, max_frame_bytes=0)
    config = tmp_path / "bad.toml"
    config.write_text("not_a_setting = 1\n")
    with pytest.raises(ConfigError, match="not_a_setting"):
        load_settings(config)
    config.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(config)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_client_names_numbering_from_base_come_as_json_or_a_toml_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DEDUP_PROXY_CLIENTS_NUMBERING_FROM_BASE", raising=False)
    assert load_settings(None).clients_numbering_from_base == []
    config = tmp_path / "proxy.toml"
    config.write_text('clients_numbering_from_base = ["ClickHouse"]\n')
    assert load_settings(config).clients_numbering_from_base == ["ClickHouse"]
    monkeypatch.setenv("DEDUP_PROXY_CLIENTS_NUMBERING_FROM_BASE", '["karafka", "my-wrapper"]')
    assert load_settings(config).clients_numbering_from_base == ["karafka", "my-wrapper"]


def test_the_write_permission_ttl_is_a_setting_and_zero_asks_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEDUP_PROXY_WRITE_PERMISSION_TTL_S", raising=False)
    assert load_settings(None).write_permission_ttl_s == 30.0
    monkeypatch.setenv("DEDUP_PROXY_WRITE_PERMISSION_TTL_S", "0")
    assert load_settings(None).write_permission_ttl_s == 0.0
    with pytest.raises(ConfigError, match="write_permission_ttl_s"):
        load_settings(None, write_permission_ttl_s=-1)
