"""What a replica's /metrics shows for a status board: one scrape of a ``ReplicaCollector``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from subscriber_ext.observe.replica_metrics import ReplicaCollector
from subscriber_ext.observe.status_board import StatusBoard


def scrape(board: StatusBoard) -> str:
    """The text exposition of ``board``'s ranks, as a Prometheus scrape reads it."""
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(board))
    return generate_latest(registry).decode()
