"""The admin API behind bearer tokens, through a real proxy: nothing changes without an
admin token, a read token reads (and serves `DedupProducer`), probes stay open."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from dedup.client import DedupProducer
from deploy.launcher import ProxyProcess
from deploy.local import EnvInfo
from tests.support.ports import ADMIN_AUTH
from tests.support.proxies import own_proxy
from tests.support.topics import new_topic

pytestmark = pytest.mark.integration

ADMIN = "admin-token-0123456789abcdef"
READER = "read-token-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(
    local_env: EnvInfo, tmp_path_factory: pytest.TempPathFactory, redis_key_prefix: str
) -> Iterator[ProxyProcess]:
    home = tmp_path_factory.mktemp("admin-auth")
    tokens = home / "tokens"
    tokens.write_text(f"# scope token\nadmin {ADMIN}\n")
    process = own_proxy(
        local_env,
        ADMIN_AUTH,
        f"{redis_key_prefix}-admin-auth",
        home / "proxy.log",
        DEDUP_PROXY_ADMIN_TOKENS_FILE=str(tokens),
        DEDUP_PROXY_ADMIN_TOKENS=f"read:{READER}",
    ).start()
    yield process
    assert process.stop() == 0
    log = (home / "proxy.log").read_text()
    assert ADMIN not in log and READER not in log, "a token reached the log"


def call(
    proxy: ProxyProcess, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        proxy.admin_url + path, data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


@pytest.mark.parametrize("token", [None, "not-a-token-of-this-proxy", READER])
def test_a_write_without_an_admin_token_changes_nothing(
    guarded: ProxyProcess, token: str | None
) -> None:
    status, text = call(guarded, "PUT", "/v1/policies/global", token, {"mode": "disabled"})
    assert status == (403 if token == READER else 401), text
    status, text = call(guarded, "GET", "/v1/policies", ADMIN)
    assert status == 200 and json.loads(text)["global"] is None, text
    status, _ = call(guarded, "POST", "/v1/topics/t/partitions/0/recover", token)
    assert status == (403 if token == READER else 401)


def test_reads_need_a_token_and_probes_do_not(guarded: ProxyProcess) -> None:
    assert call(guarded, "GET", "/v1/policies", None)[0] == 401
    assert call(guarded, "GET", "/v1/policies", READER)[0] == 200
    assert call(guarded, "GET", "/healthz", None)[0] == 200
    assert call(guarded, "GET", "/metrics", None)[0] == 200


def test_an_admin_token_changes_policies(guarded: ProxyProcess) -> None:
    topic = "auth-policy-topic"
    status, text = call(guarded, "PUT", f"/v1/policies/topics/{topic}", ADMIN, {"mode": "require"})
    assert status == 200, text
    status, text = call(guarded, "DELETE", f"/v1/policies/topics/{topic}", ADMIN)
    assert status == 200, text


def test_a_producer_with_a_read_token_gets_its_name_and_resumes(
    guarded: ProxyProcess, local_env: EnvInfo
) -> None:
    topic = new_topic(local_env.bootstrap)
    first = DedupProducer(guarded.bootstrap, admin_url=guarded.admin_url, admin_token=READER)
    for sequence in range(5):
        first.send(topic, f"{sequence}".encode(), sequence_id=sequence)
    assert first.flush(60) == 0
    again = DedupProducer(
        guarded.bootstrap, first.producer_name, admin_url=guarded.admin_url, admin_token=READER
    )
    assert again.last_sequence_id(topic) == 4
    with pytest.raises(urllib.error.HTTPError) as refused:
        DedupProducer(guarded.bootstrap, admin_url=guarded.admin_url)  # no token
    assert refused.value.code == 401
