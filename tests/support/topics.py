"""Fresh topics for tests, usable the moment they are returned (`deploy.topics`)."""

from __future__ import annotations

import time

from confluent_kafka import KafkaException

from deploy.topics import create_topic, delete_topic


def new_topic(
    bootstrap: str,
    config: dict[str, str] | None = None,
    partitions: int = 1,
    replication_factor: int = -1,
    client_config: dict[str, str] | None = None,
) -> str:
    """A fresh ``t-<random>`` topic, returned once every partition's leader serves it
    (``client_config``: the admin client's security settings)."""
    return create_topic(
        bootstrap,
        partitions=partitions,
        replication_factor=replication_factor,
        config=config,
        timeout_s=30,
        client_config=client_config,
    )


def delete_and_create_again(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """The topic deleted, then created again under its name (a new topic id, an empty
    log), returned once the new one is served."""
    delete_topic(bootstrap, topic)
    create_again(bootstrap, topic, partitions)


def create_again(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """The deleted topic created again under its name, returned once it is served."""
    deadline = time.monotonic() + 60
    while True:  # the deletion completes a moment after it is acknowledged
        try:
            create_topic(bootstrap, name=topic, partitions=partitions, timeout_s=30)
            return
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic} could not be created again") from exc
            time.sleep(0.2)
