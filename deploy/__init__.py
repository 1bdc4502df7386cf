"""Deployment: the local Kafka (KRaft, from Maven Central) and Redis the project runs on."""
