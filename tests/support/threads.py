"""Where work handed to `asyncio.to_thread` really runs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest


def record_to_thread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch `asyncio.to_thread` to note the thread each function it is given runs in; the
    list it returns fills as they run."""
    ran_in: list[int] = []
    real_to_thread = asyncio.to_thread

    async def spy(func: Any, *args: Any, **kwargs: Any) -> Any:
        def recorded() -> Any:
            ran_in.append(threading.get_ident())
            return func(*args, **kwargs)

        return await real_to_thread(recorded)

    monkeypatch.setattr(asyncio, "to_thread", spy)
    return ran_in
