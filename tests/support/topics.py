"""Fresh topics for tests, usable the moment they are returned (`deploy.topics`)."""

from __future__ import annotations

from deploy.topics import create_topic


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
