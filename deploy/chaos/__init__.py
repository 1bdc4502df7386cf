"""The chaos suite: the seed's dedup experiment, reproduced against the proxy."""
