"""Dedup's settings: the Redis state, policies, identity headers, recovery and snapshots.

Same sources and ``DEDUP_PROXY_`` prefix as the runtime's `ProxySettings`; the application
(`dedup.app.settings`) combines both into one flat class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dedup.identity import DEFAULT_PRODUCER_HEADER, DEFAULT_SEQUENCE_HEADER
from dedup.redis_connect import TLS_SCHEMES


class DedupSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DEDUP_PROXY_",
        extra="forbid",
        validate_default=True,
    )

    redis: str = Field(default="redis://127.0.0.1:16379/0", description="Redis URL")
    redis_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="a Redis command unanswered this long fails (the Produce it served is "
        "answered 'retry')",
    )
    redis_connect_timeout_s: float = Field(
        default=2.0, gt=0, description="connecting to Redis (each Sentinel at most 1 s)"
    )
    bind_producer_names: bool = Field(
        default=True,
        description="on a topic, a producer name belongs to the principal whose "
        "authenticated client used it first; another principal's records under it are "
        "refused (TOPIC_AUTHORIZATION_FAILED); anonymous connections are not checked",
    )
    producer_name_prefixes: dict[str, str] = Field(
        default_factory=dict,
        description="name prefix -> principal (JSON in the environment, e.g. "
        '{"orders-": "User:orders-app"}): names starting with it belong to that principal '
        "whoever used them first (with bind_producer_names)",
    )
    redis_tls_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle that Redis's certificate chains to (a rediss:// URL; "
        "default: the system's)",
    )
    redis_tls_cert_file: Path | None = Field(
        default=None, description="PEM client certificate, for a Redis that asks for one"
    )
    redis_tls_key_file: Path | None = Field(default=None, description="its PEM private key")
    dedup: bool = Field(
        default=True,
        description="dedup for topics without a policy (the proxy-wide default; --no-dedup)",
    )
    dedup_producer_header: str = Field(default=DEFAULT_PRODUCER_HEADER, min_length=1)
    dedup_sequence_header: str = Field(default=DEFAULT_SEQUENCE_HEADER, min_length=1)
    redis_key_prefix: str = Field(default="dedup", min_length=1)
    policy_cache_s: float = Field(
        default=1.0, ge=0, description="how long a proxy may use policies before re-reading"
    )
    check_state: Literal["memory", "redis"] = Field(
        default="memory",
        description="where the check's pushed / persisted maps live: 'memory', in the "
        "instance that owns the partition (Pulsar's way: no Redis round trip per request; "
        "Redis gets the acknowledged positions written behind), or 'redis', checked there "
        "by a Lua script on every request",
    )
    persisted_linger_s: float = Field(
        default=0.005,
        ge=0,
        le=1,
        description="how long acknowledged sequences wait to share one Redis write with the "
        "acks that follow (check_state redis: a re-send meanwhile is answered 'retry', never "
        "taken as new)",
    )
    max_batch_records: int = Field(
        default=50_000,
        gt=0,
        description="records in one partition batch of a Produce request (more: "
        "MESSAGE_TOO_LARGE, which Kafka's Java producer answers by splitting the batch)",
    )
    max_batch_decompressed_bytes: int = Field(
        default=32 << 20,
        gt=0,
        description="what one partition batch may decompress to (more: MESSAGE_TOO_LARGE; "
        "decompression stops there)",
    )
    max_request_decompressed_bytes: int = Field(
        default=128 << 20,
        gt=0,
        description="what all the partition batches of one Produce request may decompress to",
    )
    max_headers_per_record: int = Field(
        default=1_000, gt=0, description="headers of one record (more: INVALID_RECORD)"
    )
    max_producer_name_bytes: int = Field(
        default=256,
        gt=0,
        description="bytes of a dedup.producer name (longer: INVALID_RECORD); every name is "
        "kept in Redis and in snapshots",
    )
    max_sequence_jump: int = Field(
        default=0,
        ge=0,
        description="a record more than this above its producer's last sequence on the "
        "partition is refused (INVALID_RECORD), so that a forged huge sequence cannot make "
        "the producer's next records read as duplicates; 0: no bound (holes are allowed)",
    )
    native_record_scan: bool = Field(
        default=True,
        description="read uniform batches with the Rust record scan (dedup._records) where "
        "it is built; false: every batch is read by the Python readers (the same answers, "
        "several times slower), without a rebuild",
    )
    first_sequence_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="after a partition changes owner (a handoff, a takeover, a restart), how "
        "long a Kafka producer with implicit identities that the partition's log does not "
        "name must start at sequence 0, its later requests refused (retriable) meanwhile: "
        "its first request, sent to the owner before, may still come, and written after a "
        "later one it would be dropped as duplicates; at least the clients' request timeout "
        "(Kafka's Java producer: 30 s); 0: no wait",
    )
    max_producers_per_partition: int = Field(default=10_000, gt=0)
    max_absent_partitions: int = Field(
        default=10_000,
        gt=0,
        description="partitions Kafka does not have (never created, or their topic deleted) "
        "whose state is kept, the latest first: a client naming partitions that do not exist, "
        "or topics deleted one after another, cannot grow the proxy's memory beyond that",
    )
    recent_append_producers: int = Field(
        default=10_000,
        ge=0,
        description="(producer, partition) pairs whose latest 5 runs' offsets are kept "
        "(a run: batches that follow each other in the log), the latest written first, so "
        "a batch sent again and dropped as a duplicate is answered with its original's "
        "offset and log append time, as Kafka answers one "
        "(about 1 KB each); a re-send beyond them is answered offset -1; 0: none kept",
    )
    clients_numbering_from_base: list[str] = Field(
        default_factory=list,
        description="client software names (as their ApiVersions request gives them, "
        "KIP-511) that number a batch's delivery reports from the answer's base offset, "
        "as librdkafka does, besides the ones the proxy knows (librdkafka, Confluent's "
        "clients, any name or version with 'rdkafka'): a batch re-sent where no offset is "
        "right is answered minus its record count, not -1, so none of its records is "
        "reported at another record's offset (JSON in the environment)",
    )
    write_permission_ttl_s: float = Field(
        default=30.0,
        ge=0,
        description="how long Kafka's answer to whether a client may write a topic is kept "
        "per connection (the proxy writes deduplicated records under its own principal, so "
        "it asks Kafka, as the client, before it takes a request): an ACL taken away reaches "
        "that connection's writes through dedup within this long; 0 asks at every request, "
        "as Kafka checks, one Metadata round trip on the client's connection each",
    )
    producer_idle_timeout_s: float = Field(default=6 * 3600, gt=0)
    instance_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="stable name of this proxy instance, unique among the live ones: a restart "
        "with the same name fences the writes its previous run left in flight (default: the "
        "advertised host, or the machine's name for a wildcard or loopback listener, and the "
        "listen port)",
    )
    snapshot_topic: str = Field(default="__dedup_snapshots", pattern=r"^[A-Za-z0-9._-]+$")
    snapshot_topic_partitions: int = Field(default=1, gt=0)
    snapshot_every_records: int = Field(default=1000, gt=0)
    snapshot_every_s: float = Field(default=120.0, gt=0)
    topic_id_check_s: float = Field(
        default=10.0,
        gt=0,
        description="how often the owner asks Kafka the ids of the topics it holds "
        "partitions of: a topic deleted and created again is rebuilt from its new log by "
        "then even if no request of it drops records, and the partitions of a topic "
        "deleted are given up",
    )
    max_producers_per_snapshot: int = Field(default=10_000, gt=0)
    snapshot_appends: bool = Field(
        default=True,
        description="snapshots carry where each producer's latest batches are, so the next "
        "owner answers their re-sends with their offsets; false while proxies of a version "
        "before this field may read the snapshots (a rolling upgrade): those read such a "
        "snapshot as damaged and replay longer",
    )
    ambiguous_write_give_up_s: float = Field(
        default=120.0,
        gt=0,
        description="after this long an ambiguous upstream write is given up on, and its "
        "partition fenced and recovered from the log",
    )
    replay_timeout_s: float = Field(
        default=60.0, gt=0, description="a replay that makes no progress this long fails"
    )
    replay_transaction_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="a replay that finds a transaction open in the log waits at least this "
        "long for it to end, and this long when Kafka does not tell when it will abort it "
        "(0: no wait); past the wait, that transaction's records count as if committed",
    )
    replay_transaction_wait_max_s: float = Field(
        default=930.0,
        ge=0,
        description="the longest a replay waits for the deadline Kafka gives an open "
        "transaction (its start plus its transaction.timeout.ms, plus 30 s): Kafka's "
        "default transaction.max.timeout.ms is 15 min",
    )
    produce_connections_per_broker: int = Field(
        default=4,
        ge=1,
        le=64,
        description="connections the proxy writes to each broker on; a partition stays on "
        "one while it has writes in flight, the others take the least loaded, so one "
        "client's huge request or a partition with slow followers does not hold the rest",
    )
    placement: Literal["balanced", "sidecar"] = Field(
        default="balanced",
        description="who owns each partition's dedup: spread over the live instances "
        "(balanced), or the instance beside the partition's leader (sidecar)",
    )
    local_broker_id: int | None = Field(
        default=None,
        ge=0,
        description="sidecar placement: the node id of the broker this instance stands beside",
    )
    lease_ttl_s: float = Field(
        default=6.0,
        gt=0,
        description="an instance that has not renewed its membership and leases for this "
        "long is taken for dead; its partitions are taken over (fenced, then replayed)",
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, description="how often membership and leases are renewed"
    )
    node_id_stride: int = Field(
        default=1000,
        ge=2,
        description="balanced placement: clients see broker b behind instance slot s as node "
        "s * node_id_stride + b (broker node ids must be below it)",
    )

    @model_validator(mode="after")
    def _placement_needs(self) -> DedupSettings:
        if self.placement == "sidecar" and self.local_broker_id is None:
            raise ValueError("placement 'sidecar' needs local_broker_id (--local-broker-id)")
        if self.heartbeat_s * 3 > self.lease_ttl_s:
            raise ValueError("lease_ttl_s must be at least three heartbeats (heartbeat_s)")
        files = (self.redis_tls_ca_file, self.redis_tls_cert_file, self.redis_tls_key_file)
        if any(files) and self.redis.partition("://")[0].lower() not in TLS_SCHEMES:
            raise ValueError(
                "redis_tls_* settings need a TLS Redis URL (rediss://, rediss+sentinel://, "
                "rediss+cluster://)"
            )
        if (self.redis_tls_cert_file is None) != (self.redis_tls_key_file is None):
            raise ValueError("redis_tls_cert_file and redis_tls_key_file go together")
        for path in files:
            if path is not None and not path.is_file():
                raise ValueError(f"{path} (a redis_tls_* setting) is not a file")
        return self

    @property
    def redis_tls(self) -> dict[str, str]:
        """The redis-py settings of a rediss:// connection (empty: its defaults)."""
        given = {
            "ssl_ca_certs": self.redis_tls_ca_file,
            "ssl_certfile": self.redis_tls_cert_file,
            "ssl_keyfile": self.redis_tls_key_file,
        }
        return {name: str(path) for name, path in given.items() if path is not None}
