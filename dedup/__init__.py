"""The deduplication engine (PIP-6 on Kafka): identity, the check, state, recovery."""
