"""Background tasks never end unseen (`proxy.runtime.background`): a pass of a loop that
fails unexpectedly is counted and the loop goes on; a task that ends with an error is
counted, makes /healthz report the process unhealthy, naming it, and shuts the proxy down
gracefully (`run_proxy` then raises, for a non-zero exit); one that returns or is
cancelled has ended as it should."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.runtime import background, metrics
from proxy.runtime.admin import build_admin_app
from proxy.runtime.lifecycle import BackgroundFailure, run_proxy
from proxy.runtime.settings import ProxySettings


@pytest.fixture(autouse=True)
def no_failures_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "_failed", {})
    monkeypatch.setattr(background, "_listeners", [])


def failures(name: str) -> float:
    return metrics.BACKGROUND_FAILURES.labels(name)._value.get()  # type: ignore[no-any-return]


def pass_errors(name: str) -> float:
    return metrics.BACKGROUND_PASS_ERRORS.labels(name)._value.get()  # type: ignore[no-any-return]


def test_a_pass_that_fails_unexpectedly_is_counted_and_the_loop_goes_on() -> None:
    before = pass_errors("watch")
    ran = []
    for outcome in (ValueError("a malformed record"), None):
        with background.one_pass("watch"):
            ran.append(outcome)
            if outcome is not None:
                raise outcome
    assert len(ran) == 2
    assert pass_errors("watch") == before + 1
    assert background.failed() == {}, "a failed pass is not a failed task"


def test_cancelling_a_pass_is_not_an_error_of_it() -> None:
    before = pass_errors("watch")
    with pytest.raises(asyncio.CancelledError), background.one_pass("watch"):
        raise asyncio.CancelledError
    assert pass_errors("watch") == before


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


class FakeServer(SimpleNamespace):
    """What the lifecycle and the admin app use of a `ProxyServer`; its metadata fresh."""

    def __init__(self) -> None:
        super().__init__(
            settings=ProxySettings(upstream="127.0.0.1:9092", admin="127.0.0.1:0"),
            last_refresh_ok=asyncio.get_running_loop().time(),
            topology=SimpleNamespace(node_ids={0}),
            broker_ports=lambda: {0: 40000},
            calls=[],
        )

    async def start(self) -> None:
        self.calls.append("start")

    async def shutdown(self) -> None:
        self.calls.append("shutdown")


async def test_healthz_is_unavailable_once_a_background_task_failed() -> None:
    server = FakeServer()
    status, body = await health(server)
    assert (status, body["status"], body["failed_tasks"]) == (200, "ok", {})

    async def refresh() -> None:
        raise RuntimeError("stopped")

    await ended(background.start(refresh(), "metadata-refresh"))
    status, body = await health(server)
    assert (status, body["status"]) == (503, "unavailable")
    assert body["failed_tasks"] == {"metadata-refresh": "RuntimeError: stopped"}


async def test_a_failed_background_task_shuts_the_proxy_down_then_raises() -> None:
    server = FakeServer()
    running = asyncio.ensure_future(run_proxy(server))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert server.calls == ["start"] and not running.done()

    async def beat() -> None:
        raise RuntimeError("lost")

    background.start(beat(), "ownership")
    with pytest.raises(BackgroundFailure, match="ownership"):
        await asyncio.wait_for(running, 10)
    assert server.calls == ["start", "shutdown"]
    assert background._listeners == [], "the lifecycle stopped listening"
