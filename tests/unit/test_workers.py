"""`serve --workers N`: the plan of each worker's ports and id, the port checks, and the
environment and command line a worker is started with."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dedup.app.settings import Settings, load_settings
from dedup.app.workers import plan_workers, settings_environment, worker_argv, worker_env
from deploy.tls import LocalTls
from proxy.runtime.settings import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DEDUP_PROXY_"):
            monkeypatch.delenv(name)


def test_plan_gives_each_worker_its_id_broker_ports_and_admin_port() -> None:
    settings = load_settings(
        None, listen="0.0.0.0:9192", admin="127.0.0.1:9180", instance_id="edge", workers=3
    )
    plan = plan_workers(settings)
    assert [w.instance_id for w in plan] == ["edge-w0", "edge-w1", "edge-w2"]
    assert {w.listen for w in plan} == {"0.0.0.0:9192"}  # one shared bootstrap port
    assert [w.broker_port_base for w in plan] == [9193, 9293, 9393]
    assert [w.admin for w in plan] == ["127.0.0.1:9180", "127.0.0.1:9181", "127.0.0.1:9182"]
    assert [w.advertised_broker_port_base for w in plan] == [None, None, None]
    assert plan[1].admin_url == "http://127.0.0.1:9181"


def test_plan_follows_the_stride_and_the_advertised_base() -> None:
    settings = load_settings(
        None,
        listen="127.0.0.1:9192",
        admin="127.0.0.1:9000",
        broker_port_base=10000,
        advertised_broker_port_base=20000,
        worker_port_stride=10,
        workers=2,
    )
    plan = plan_workers(settings)
    assert [w.broker_port_base for w in plan] == [10000, 10010]
    assert [w.advertised_broker_port_base for w in plan] == [20000, 20010]
    # Without an explicit id, the supervisor's effective id is the root of each worker's.
    assert plan[0].instance_id == f"{settings.effective_instance_id}-w0"


def test_one_worker_is_the_default_and_checks_nothing() -> None:
    settings = load_settings(None, listen="127.0.0.1:9192", admin="127.0.0.1:9193")
    assert settings.workers == 1
    assert settings.reuse_port is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The second worker's broker ports (9293..9392) hold the admin port.
        (dict(listen="127.0.0.1:9192", admin="127.0.0.1:9300"), "admin port of worker 0"),
        # The admin ports of three workers reach the bootstrap port.
        (dict(listen="127.0.0.1:9192", admin="127.0.0.1:9190"), "bootstrap listener"),
        # The bootstrap port inside the broker ports of a worker.
        (
            dict(listen="127.0.0.1:9300", admin="127.0.0.1:9100", broker_port_base=9200),
            "port 9300 \\(the bootstrap listener\\) is one of worker 1's broker ports",
        ),
        # Past the last port.
        (dict(listen="127.0.0.1:65400", admin="127.0.0.1:9100"), "past 65535"),
        (dict(listen="127.0.0.1:9192", admin="127.0.0.1:9100", worker_port_stride=0), "stride"),
        (dict(listen="127.0.0.1:9192", admin="127.0.0.1:9100", workers=0), "workers"),
    ],
)
def test_ports_that_clash_or_do_not_fit_are_refused(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(None, **{"workers": 3, **overrides})


def test_the_environment_gives_a_worker_exactly_the_supervisor_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text('upstream = ["k1:9092", "k2:9092"]\nsnapshot_every_s = 7.5\n')
    settings = load_settings(
        config, listen="127.0.0.1:9192", admin="127.0.0.1:9100", workers=2, dedup=False
    )
    (first, second) = plan_workers(settings)
    env = worker_env(settings, second, {"PATH": "/bin", "DEDUP_PROXY_REDIS": "redis://stale"})
    assert env["PATH"] == "/bin"
    assert env["DEDUP_PROXY_UPSTREAM"] == "k1:9092,k2:9092"
    assert env["DEDUP_PROXY_WORKERS"] == "1"
    assert env["DEDUP_PROXY_REUSE_PORT"] == "true"
    assert env["DEDUP_PROXY_DEDUP"] == "false"
    assert env["DEDUP_PROXY_REDIS"] == settings.redis  # the resolved one, not the stale one
    assert "DEDUP_PROXY_ADVERTISED_BROKER_PORT_BASE" not in env  # None: not set
    # Loading settings from that environment alone (no file, no flags) gives the worker's.
    loaded = _load_from(env)
    expected = settings.model_dump() | second.overrides()
    assert loaded.model_dump() == expected
    assert first.instance_id != second.instance_id


def _load_from(env: dict[str, str]) -> Settings:
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return load_settings(None)


def test_settings_environment_skips_unset_fields() -> None:
    settings = load_settings(None, listen="127.0.0.1:9192", admin="127.0.0.1:9100")
    env = settings_environment(settings, {})
    assert "DEDUP_PROXY_INSTANCE_ID" not in env
    assert "DEDUP_PROXY_BROKER_PORT_BASE" not in env
    assert env["DEDUP_PROXY_LISTEN"] == "127.0.0.1:9192"


def test_workers_get_the_secrets_themselves_not_their_masks() -> None:
    settings = load_settings(
        None,
        upstream_security_protocol="SASL_PLAINTEXT",
        upstream_sasl_mechanism="PLAIN",
        upstream_sasl_username="proxy",
        upstream_sasl_password="pw-123",
    )
    env = settings_environment(settings, {})
    assert env["DEDUP_PROXY_UPSTREAM_SASL_PASSWORD"] == "pw-123"
    assert _load_from(env).upstream_security.librdkafka()["sasl.password"] == "pw-123"


def test_worker_command_line_names_the_worker(tmp_path: Path) -> None:
    settings = load_settings(
        None, listen="127.0.0.1:9192", admin="127.0.0.1:9100", instance_id="p", workers=2
    )
    spec = plan_workers(settings)[1]
    argv = worker_argv(spec, tmp_path / "proxy.toml")
    assert argv[:4] == [sys.executable, "-m", "dedup", "serve"]
    assert argv[4:6] == ["--config", str(tmp_path / "proxy.toml")]
    assert "--workers" not in argv
    flags = dict(zip(argv[6::2], argv[7::2], strict=True))
    assert flags == {
        "--instance-id": "p-w1",
        "--listen": "127.0.0.1:9192",
        "--admin": "127.0.0.1:9101",
        "--broker-port-base": "9293",
    }


def test_sni_routing_takes_one_worker(tmp_path: Path) -> None:
    certs = LocalTls(tmp_path).ensure()
    sni = dict(
        listen="127.0.0.1:9192",
        admin="127.0.0.1:9100",
        listener_tls_cert_file=certs.server_cert_file,
        listener_tls_key_file=certs.server_key_file,
        sni_bootstrap_host="bootstrap.kafka.example.com",
        sni_broker_host_pattern="broker-{node_id}.kafka.example.com",
    )
    assert load_settings(None, **sni).sni_routing is not None
    with pytest.raises(ConfigError, match="cannot choose its worker"):
        load_settings(None, workers=2, **sni)
