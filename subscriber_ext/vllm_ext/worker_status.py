"""What a worker says about itself: the status RPCs' dict and the /metrics status file.

Why apart from ``worker_extension.py`` (subscription and commit): reporting only
reads the rank's state (coordinator, applier, version source, metrics) and never
changes it; a thread writes the snapshot to the ``StatusBoard`` the front end's
``/metrics`` reads, so it must never raise into the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from subscriber_ext.observe.receive_table import rank_receive
from subscriber_ext.observe.replica_metrics import peer_nixl_counters, peer_stream_counters
from subscriber_ext.observe.status_board import StatusBoard
from subscriber_ext.vllm_ext.worker_state import StateAccess

__all__ = ["STATUS_INTERVAL_S", "WorkerStatus"]

logger = logging.getLogger("weightpub.worker")

STATUS_INTERVAL_S = 1.0  # how often each rank refreshes its status file for /metrics


class WorkerStatus(StateAccess):
    """Mixed into the worker extension: this rank's status, for RPCs and /metrics."""

    def _wp_start_status_writer(self) -> None:
        st = self._wp()
        board = StatusBoard.from_env()
        if board is None or st.status_writer is not None:
            return
        st.status_writer = threading.Thread(target=self._wp_publish_status, args=(board,),
                                            name="weightpub-status", daemon=True)
        st.status_writer.start()

    def _wp_publish_status(self, board: StatusBoard) -> None:
        """Writer thread: this rank's versions and metrics, for the front end's /metrics."""
        st = self._wp()
        while True:
            try:
                board.write(self.rank, self._wp_metrics_snapshot())
            except Exception:  # never let metrics take a worker down
                logger.exception("weightpub: status file write failed")
            time.sleep(STATUS_INTERVAL_S)
            if st.status_writer is None:
                return

    def _wp_metrics_snapshot(self) -> dict[str, Any]:
        st = self._wp()
        coord = st.coordinator
        source = {}
        if st.source is not None:
            try:
                source = st.source.status()
            except Exception:
                source = {}
        metrics = st.metrics.to_json()
        for name, count in (source.get("failures") or {}).items():
            metrics["failures"][name] = metrics["failures"].get(name, 0) + int(count)
        # a follower shows its node owner's subscription; its own bytes come from shared memory
        follower = _part(source, "node_staging").get("role") == "follower"
        stream = _part(source, "stream")
        return {
            "rank": self.rank,
            "applied_version": coord.applied_version if coord else None,
            "staged_version": coord.staged_version() if coord else None,
            "publisher_latest_version": source.get("publisher_latest_version"),
            "received_bytes": 0 if follower else source.get("received_bytes", 0),
            # how the applied version's bytes reached this node: zmq, gloo, nccl, cuda_ipc
            "data_path": coord.applied_data_path if coord else None,
            # versions held back for the collective path but fetched over ZeroMQ, by cause
            # (the node's subscription: counted at its owner rank only)
            "collective_fallbacks": {} if follower else _fallbacks(source, "collective"),
            # chunks of versions offered over NIXL fetched over ZeroMQ instead, by cause
            "nixl_fallbacks": {} if follower else _fallbacks(source, "nixl"),
            # chunks of versions offered on the stream port fetched as frames, by cause
            "stream_fallbacks": {} if follower else _fallbacks(source, "stream"),
            # chunk bytes that came over the stream port (the part of received_bytes)
            "stream_received_bytes": 0 if follower else stream.get("bytes_received", 0),
            # the stream path's landing scratch held now, and slices read in place for want
            # of room to land them (``stream_source.py``)
            "stream_scratch_bytes": 0 if follower else stream.get("scratch_bytes", 0),
            "stream_landing_refused": 0 if follower else stream.get("landing_refused", 0),
            # versions the subscription gave up (the newest: ``abandoned`` in its status)
            "versions_abandoned": 0 if follower else source.get("abandoned_versions", 0),
            # versions announced before their sums (``announce_early``): versions, sum
            # replies, chunks whose bytes waited for their sum
            "early_sums": {} if follower else dict(source.get("early_sums") or {}),
            # peers over NIXL: bytes and chunks READ from peers, offers made and refused
            "peer_nixl": {} if follower else peer_nixl_counters(source),
            # peers over the stream: bytes and chunks asked on peers' ports, fallbacks by
            # cause; what its own port served (bytes, chunks, tokens, cuts, CPU)
            "peer_stream": {} if follower else peer_stream_counters(source),
            "prepare_budget": st.applier.prepare_budget.status() if st.applier else None,
            # how this rank receives and what its applied version cost (``receive_table.py``)
            "receive": self._wp_receive_row(source),
            "metrics": metrics,
        }

    def _wp_receive_row(self, source_status: dict[str, Any] | None) -> dict[str, Any] | None:
        st = self._wp()
        if st.receive is None:
            return None
        return rank_receive(self.rank, st.receive.status(), source_status)

    def _wp_status(self) -> dict[str, Any]:
        st = self._wp()
        coord = st.coordinator
        applier = st.applier
        report = applier.last_report if applier else None
        source_status = None
        if st.source is not None:
            try:
                source_status = st.source.status()
            except Exception as exc:
                source_status = {"error": str(exc)}
        stream = _part(source_status, "stream")
        return {
            "rank": self.rank,
            "endpoint": st.endpoint,
            "applied_version": coord.applied_version if coord else None,
            "data_path": coord.applied_data_path if coord else None,
            "staged_version": coord.staged_version() if coord else None,
            "publisher_id": coord.publisher_id if coord else None,
            "last_error": (coord.last_error if coord else None)
            or (source_status or {}).get("refused") or st.last_error,
            "apply_mode": applier.mode() if applier else st.options.apply_mode,
            "last_apply_s": report.seconds if report else None,
            # the newest few: this dict crosses the RPC boundary on every poll
            "commits": list(coord.commit_log)[-16:] if coord else [],
            "commit_count": coord.commit_count if coord else 0,
            "prepare": coord.prepare_status() if coord else None,
            # bytes prepared shadows may hold and hold now (``apply/prepare_budget.py``)
            "prepare_budget": applier.prepare_budget.status() if applier else None,
            # glibc heap memory given back after commits (``weightpub_wire/heap_trim.py``)
            "heap_trim": coord.heap_trim.status() if coord else None,
            # LoRA adapter versions served by name or merged (``lora/``), None: none yet
            "lora": st.adapter_server.status() if st.adapter_mode == "serve"
            and st.adapter_server is not None else st.adapter_merger.status()
            if st.adapter_mode == "merge" and st.adapter_merger is not None else None,
            "step": coord.step if coord else 0,
            "step_check_s": st.step_check_s,
            "driven": coord.driven if coord else st.slots is not None,
            "collectives": coord.strategy.collectives if coord else 0,
            # the node's collective path: versions fetched over ZeroMQ instead, by cause
            "collective_fallbacks": _fallbacks(source_status, "collective"),
            # the node's NIXL path: versions (or chunks) fetched over ZeroMQ instead, by cause
            "nixl_fallbacks": _fallbacks(source_status, "nixl"),
            # the node's stream path (``stream=True``): chunks fetched as frames, by cause
            "stream_fallbacks": _fallbacks(source_status, "stream"),
            # its landing scratch held now, slices read in place for want of room
            "stream_scratch_bytes": stream.get("scratch_bytes", 0),
            "stream_landing_refused": stream.get("landing_refused", 0),
            # the newest version the subscription gave up ({"version", "why"}), or None
            "abandoned": (source_status or {}).get("abandoned"),
            # each rank its own slices, node staging or whole (``receive_choice.py``), with
            # its plan's share and what the applied version cost it (``receive_table.py``)
            "receive": self._wp_receive_row(source_status),
            "seed_tensors": st.seed_tensors,
            "seed_pending": sorted(st.seed_pending),
            "subscriber": source_status,
        }


def _part(status: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """One part of a subscriber's status (``{}``: no status, or no such part)."""
    return (status or {}).get(name) or {}


def _fallbacks(status: dict[str, Any] | None, path: str) -> dict[str, int]:
    """A data path's fallbacks by cause, from a subscriber's status (a copy)."""
    return dict(_part(status, path).get("fallback_causes") or {})
