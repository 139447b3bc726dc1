"""Sharded trainers: rank 0's coordinator joins every rank's shard into one announced version."""
