"""The Kafka-protocol proxy: listeners, connections, codec, filters, admin and CLI."""
