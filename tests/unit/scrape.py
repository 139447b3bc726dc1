"""What a replica's /metrics shows for a status board: one scrape of a ``ReplicaCollector``;
and what a worker rank reports of its subscriber (status RPC, /metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from subscriber_ext.observe.replica_metrics import ReplicaCollector
from subscriber_ext.observe.status_board import StatusBoard
from subscriber_ext.vllm_ext.worker_status import WorkerStatus


def scrape(board: StatusBoard) -> str:
    """The text exposition of ``board``'s ranks, as a Prometheus scrape reads it."""
    registry = CollectorRegistry()
    registry.register(ReplicaCollector(board))
    return generate_latest(registry).decode()


class _Worker(WorkerStatus):
    """A worker's reporting alone (no vLLM): its status and status file for one source."""

    rank = 0


def worker_view(source: Any, board_dir: Path) -> tuple[dict[str, Any], str]:
    """What an operator reads of a worker rank fed by ``source`` (a subscriber): the
    worker's status RPC dict, and its replica's /metrics text."""
    worker = _Worker()
    worker._wp().source = source
    board_dir.mkdir(parents=True, exist_ok=True)
    board = StatusBoard(board_dir)
    board.write(worker.rank, worker._wp_metrics_snapshot())
    return worker._wp_status(), scrape(board)
