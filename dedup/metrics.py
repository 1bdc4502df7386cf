"""Prometheus metrics of the dedup engine (served with the proxy's on the admin port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECORDS = Counter(
    "dedup_records_total",
    "Records checked, by verdict (not_dup: forwarded, dup: dropped, unknown: refused)",
    ["verdict"],
)
# Bound once: a label lookup per request is measurable on the produce path.
NEW_RECORDS = RECORDS.labels("not_dup")
DUP_RECORDS = RECORDS.labels("dup")
CHECK_ROUND_TRIPS = Counter(
    "dedup_check_round_trips_total",
    "Redis round trips of the dedup check; Produce requests checked: dedup_checked_requests_total",
)
CHECKED_REQUESTS = Counter(
    "dedup_checked_requests_total",
    "Produce requests checked (check_state redis: in dedup_check_round_trips_total round trips)",
)
TOPIC_ID_LOOKUPS = Counter(
    "dedup_topic_id_lookups_total",
    "Topic ids asked of Kafka: at recovery, and before answering a request in which records "
    "were dropped as duplicates",
)
TOPIC_RECREATED = Counter(
    "dedup_topic_recreated_total",
    "Partitions whose topic was found deleted, or deleted and created again under its name "
    "(a new topic id): their dedup state is rebuilt from the new topic's log",
)
TOPIC_DELETED = Counter(
    "dedup_topic_deleted_total",
    "Partitions let go because their topic was deleted (and not created again): their lease "
    "given up, nothing renewed or recovered for them any more",
)
SEQUENCE_GAPS = Counter(
    "dedup_sequence_gaps_total",
    "Partition batches of Kafka idempotent producers refused (retriable) for skipping ahead: "
    "an earlier request of the producer (refused, or its first, sent to the owner before a "
    "handoff) is still to come",
)
REFUSED_BEHIND = Counter(
    "dedup_refused_behind_total",
    "Partition batches refused (retriable, not written) because a request ahead of them on "
    "the partition was answered retry before they were written, by that refusal's reach: "
    "partition (every request behind it), connection (its client connection's only) or "
    "producers (those naming one of its producers)",
    ["reach"],
)
BAD_INPUT = Counter(
    "dedup_bad_input_total", "Partition batches refused for bad input, by error", ["error"]
)
DUPLICATE_BATCHES = Counter(
    "dedup_duplicate_batches_total",
    "Partition batches dropped whole as duplicates, by the offset they were answered with: "
    "original (the one the original got, as Kafka answers a duplicate batch) or none (-1: "
    "not a batch this instance wrote lately under its hold of the partition)",
    ["offset"],
)
DUPLICATE_ORIGINAL_OFFSET = DUPLICATE_BATCHES.labels("original")
DUPLICATE_NO_OFFSET = DUPLICATE_BATCHES.labels("none")
RECENT_APPEND_PRODUCERS = Gauge(
    "dedup_recent_append_producers",
    "(producer, partition) pairs whose latest batches' offsets are kept, to answer their "
    "duplicates with them (at most recent_append_producers)",
)
EVICTIONS = Counter(
    "dedup_producer_evictions_total",
    "Producers evicted because a partition tracked its maximum number of producers",
)
SNAPSHOTS = Counter(
    "dedup_snapshots_total", "Snapshots of a partition's dedup state, by result", ["result"]
)
SNAPSHOT_PRODUCERS_DROPPED = Counter(
    "dedup_snapshot_producers_dropped_total",
    "Producers left out of a snapshot to keep it within the snapshot topic's record size",
)
SNAPSHOT_AGE = Gauge(
    "dedup_snapshot_age_seconds",
    "Age of the oldest latest snapshot among the partitions this proxy has recovered",
)
CORRUPT_SNAPSHOTS = Counter(
    "dedup_snapshots_corrupt_total", "Snapshot records found unreadable during a recovery"
)
RECOVERIES = Counter(
    "dedup_recoveries_total",
    "Partition recoveries (fence + snapshot + replay), by result",
    ["result"],
)
RECOVERY_SECONDS = Histogram(
    "dedup_recovery_seconds",
    "Time to recover one partition: fence, snapshot read, replay and Redis load",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
)
REPLAYED_RECORDS = Counter("dedup_replayed_records_total", "Records read by recovery replays")
REPLAYS_PAST_OPEN_TRANSACTIONS = Counter(
    "dedup_replays_past_open_transactions_total",
    "Replays that counted records of a transaction still open after replay_transaction_wait_s "
    "(should it abort, a re-send of its sequences outside a transaction is dropped)",
)
RECOVERING = Gauge(
    "dedup_partitions_recovering", "Partitions whose produce requests wait for a recovery"
)
RECOVERIES_FAILING = Gauge(
    "dedup_recoveries_failing",
    "Partitions whose last recovery failed (retried with a backoff of their own; "
    "/v1/snapshots says why)",
)
OWNED_PARTITIONS = Gauge("dedup_owned_partitions", "Partitions whose lease this instance holds")
WRITER_PARTITIONS = Gauge(
    "dedup_writer_partitions",
    "Partitions the proxy's idempotent writer keeps a producer and sequence for (those of "
    "deleted topics go with the oldest absent partitions: max_absent_partitions)",
)
LEASES = Counter(
    "dedup_lease_events_total",
    "Partition lease events: acquired_new, taken_over (a fenced takeover), handed_over (after a "
    "clean release), lost, released_clean, released_unclean",
    ["event"],
)
REDIRECTS = Counter(
    "dedup_redirects_total",
    "Produce partitions answered NOT_LEADER_OR_FOLLOWER because another instance owns them",
)
