"""Fresh topics for tests, usable the moment they are returned (`deploy.topics`)."""

from __future__ import annotations

from deploy.topics import create_topic


def new_topic(
    bootstrap: str,
    config: dict[str, str] | None = None,
    partitions: int = 1,
    replication_factor: int = -1,
) -> str:
    """A fresh ``t-<random>`` topic, returned once every partition's leader serves it."""
    return create_topic(
        bootstrap,
        partitions=partitions,
        replication_factor=replication_factor,
        config=config,
        timeout_s=30,
    )
