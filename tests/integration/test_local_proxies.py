"""`local up --proxies 2`: two proxy instances as detached processes in front of a local
environment of their own, listed by `status`, killed and started one at a time, stopped by
`down`."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from deploy.local import LocalEnvironment
from deploy.processes import port_open
from tests.support.kafka_io import values
from tests.support.ports import LOCAL_PROXIES_ENV, LOCAL_PROXY_BASE
from tests.support.topics import new_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOST = "127.0.0.1"


def _health(admin_url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{admin_url}/healthz", timeout=5) as answer:
        body: dict[str, object] = json.load(answer)
        return body


def test_up_with_two_proxies_then_kill_start_and_down(tmp_path: Path) -> None:
    env = LocalEnvironment(home=tmp_path / "env", ports=LOCAL_PROXIES_ENV)
    try:
        info = env.up(brokers=1, proxies=2)
        assert [p.instance_id for p in info.proxies] == ["proxy-1", "proxy-2"]
        assert [p.bootstrap for p in info.proxies] == [
            f"{HOST}:{LOCAL_PROXY_BASE}",
            f"{HOST}:{LOCAL_PROXY_BASE + 100}",
        ]
        assert [_health(p.admin)["status"] for p in info.proxies] == ["ok", "ok"]
        status = env.status()
        processes = status["proxy_processes"]
        assert [(p["running"], p["listening"]) for p in processes.values()] == [(True, True)] * 2
        assert status["proxies"] == [p.to_json() for p in info.proxies]

        # A producer through proxy-2 writes, straight from Kafka it reads back exactly.
        topic = new_topic(info.bootstrap)
        producer = Producer({"bootstrap.servers": info.proxies[1].bootstrap, "acks": "all"})
        name = f"lab-{uuid.uuid4().hex[:6]}"
        for sequence in range(3):
            headers = {"dedup.producer": name, "dedup.sequence": str(sequence)}
            producer.produce(topic, str(sequence).encode(), headers=headers)
            producer.produce(topic, str(sequence).encode(), headers=headers)  # a duplicate
        assert producer.flush(30) == 0
        assert values(info.bootstrap, topic) == [b"0", b"1", b"2"]

        # kill-proxy / start-proxy: the crash of one instance, and its return.
        assert env.kill_proxy(1) is True
        assert not port_open(HOST, LOCAL_PROXY_BASE)
        assert env.status()["proxy_processes"]["1"]["running"] is False
        assert env.status()["proxy_processes"]["2"]["running"] is True
        assert env.start_proxy(1).instance_id == "proxy-1"
        assert _health(info.proxies[0].admin)["status"] == "ok"
    finally:
        env.down(purge=True)
    assert not port_open(HOST, LOCAL_PROXY_BASE)
    assert not port_open(HOST, LOCAL_PROXY_BASE + 100)
    assert not port_open(HOST, LOCAL_PROXIES_ENV.kafka_base)
