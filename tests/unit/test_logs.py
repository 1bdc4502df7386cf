"""Log lines go where the settings say: stderr by default, stdout in a container image."""

from __future__ import annotations

import json

import pytest
import structlog

from proxy.runtime.logs import configure_logging

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_json_lines_go_to_the_chosen_stream(
    stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        configure_logging("info", "json", stream)
        structlog.get_logger("t").info("hello", n=1)
        out, err = capsys.readouterr()
        written, silent = (out, err) if stream == "stdout" else (err, out)
        assert json.loads(written.strip())["event"] == "hello"
        assert silent == ""
    finally:
        structlog.reset_defaults()
