"""The local environment's SCRAM users request: tried again after a client-side failure that
a new attempt may not meet (librdkafka drops the bootstrap broker, and a request waiting on
it, once it learns brokers that advertise other addresses), never after a refusal."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from deploy.local import LocalEnvError, _alter_scram_users

pytestmark = pytest.mark.unit


class _Upsert:
    user = "proxy"


class _Admin:
    """Answers each request with the next outcome: None for done, else the error's code."""

    def __init__(self, outcomes: list[int | None]) -> None:
        self.outcomes = outcomes
        self.requests = 0

    def alter_user_scram_credentials(self, upserts: list[Any]) -> dict[str, Future[None]]:
        outcome = self.outcomes[self.requests]
        self.requests += 1
        done: Future[None] = Future()
        if outcome is None:
            done.set_result(None)
        else:
            done.set_exception(KafkaException(KafkaError(outcome)))
        return {upsert.user: done for upsert in upserts}

    def list_topics(self, timeout: float) -> Any:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))


def test_a_destroyed_broker_handle_is_tried_again() -> None:
    admin = _Admin([KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, None])
    _alter_scram_users(admin, [_Upsert()], time.monotonic() + 30)  # type: ignore[arg-type]
    assert admin.requests == 3


def test_a_refusal_is_not_tried_again() -> None:
    admin = _Admin([KafkaError.UNSUPPORTED_SASL_MECHANISM, None])
    with pytest.raises(LocalEnvError, match="could not create SCRAM users proxy"):
        _alter_scram_users(admin, [_Upsert()], time.monotonic() + 30)  # type: ignore[arg-type]
    assert admin.requests == 1


def test_past_the_deadline_the_transient_failure_is_reported() -> None:
    admin = _Admin([KafkaError._DESTROY_BROKER, None])
    with pytest.raises(LocalEnvError, match="_DESTROY_BROKER"):
        _alter_scram_users(admin, [_Upsert()], time.monotonic() - 1)  # type: ignore[arg-type]
    assert admin.requests == 1
