"""Background tasks never end unseen (`proxy.runtime.background`): one that ends with an
error is counted and makes /healthz report the process unhealthy, naming it; one that
returns or is cancelled has ended as it should."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.runtime import background, metrics
from proxy.runtime.admin import build_admin_app
from proxy.runtime.settings import ProxySettings


@pytest.fixture(autouse=True)
def no_failures_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "_failed", {})


def failures(name: str) -> float:
    return metrics.BACKGROUND_FAILURES.labels(name)._value.get()  # type: ignore[no-any-return]


async def ended(task: asyncio.Task[None]) -> None:
    """Until the task has ended and its done callbacks have run."""
    await asyncio.wait([task])
    await asyncio.sleep(0)


async def test_a_task_ending_with_an_error_is_named_and_counted() -> None:
    async def beat() -> None:
        raise KeyError("a defect")

    before = failures("beat")
    await ended(background.start(beat(), "beat"))
    assert background.failed() == {"beat": "KeyError: 'a defect'"}
    assert failures("beat") == before + 1


async def test_a_task_that_returns_or_is_cancelled_ended_as_it_should() -> None:
    async def once() -> None:
        return None

    async def forever() -> None:
        await asyncio.Event().wait()

    await ended(background.start(once(), "once"))
    running = background.start(forever(), "forever")
    await asyncio.sleep(0)
    running.cancel()
    await ended(running)
    assert background.failed() == {}


async def health(server: Any) -> tuple[int, dict[str, Any]]:
    async with TestClient(TestServer(build_admin_app(server))) as client:
        answer = await client.get("/healthz")
        return answer.status, await answer.json()


async def test_healthz_is_unavailable_once_a_background_task_failed() -> None:
    server = SimpleNamespace(
        settings=ProxySettings(upstream="127.0.0.1:9092"),
        last_refresh_ok=asyncio.get_running_loop().time(),  # the metadata is fresh
        topology=SimpleNamespace(node_ids={0}),
        broker_ports=lambda: {0: 40000},
    )
    status, body = await health(server)
    assert (status, body["status"], body["failed_tasks"]) == (200, "ok", {})

    async def refresh() -> None:
        raise RuntimeError("stopped")

    await ended(background.start(refresh(), "metadata-refresh"))
    status, body = await health(server)
    assert (status, body["status"]) == (503, "unavailable")
    assert body["failed_tasks"] == {"metadata-refresh": "RuntimeError: stopped"}
