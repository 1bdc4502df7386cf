"""Benchmarks of the proxy against a real local Kafka (run them as modules, see README.md)."""
