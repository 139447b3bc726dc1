"""Prometheus metrics of a replica: accumulated in each worker, exposed by the front end.

Each worker rank keeps a ``RankMetrics`` (counters and fixed-bucket
histograms, JSON-able) and writes it with its versions to the replica's
``StatusBoard``; ``ReplicaCollector``, registered in the process that serves
``/metrics`` (the ``vllm serve`` front end, or an ``LLM`` user's process),
turns the files into metric families at scrape time. Names follow Prometheus
conventions: ``weightpub_`` prefix, base units (seconds, bytes), ``_total`` for
counters; every series carries the worker ``rank``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from subscriber_ext.observe.status_board import StatusBoard
from weightpub_wire.bounded_counts import count_bounded

__all__ = ["HISTOGRAMS", "PEER_NIXL_COUNTERS", "PEER_STREAM_COUNTERS", "FixedHistogram",
           "RankMetrics", "ReplicaCollector", "peer_nixl_counters", "peer_stream_counters"]

#: peers over NIXL (``docs/peers-over-nixl.md``): ``status()["peers"]`` key -> (metric
#: name, help); each a counter of the subscriber's life
PEER_NIXL_COUNTERS: dict[str, tuple[str, str]] = {
    "nixl_bytes_from_peers": ("weightpub_nixl_bytes_from_peers",
                              "Chunk bytes READ one-sided from peers' staging and verified"),
    "nixl_chunks_from_peers": ("weightpub_nixl_chunks_from_peers",
                               "Chunks READ one-sided from peers' staging and verified"),
    "nixl_offers": ("weightpub_peer_nixl_offers",
                    "peer_nixl questions this member answered with an offer of its staging"),
}

#: peers over the stream (``docs/peer-stream.md``): ``status()["peers"]`` key (the asking
#: side) or ``status()["peers"]["stream_served"]`` key (the serving side) -> (metric name,
#: help); each a counter of the subscriber's life
PEER_STREAM_COUNTERS: dict[str, tuple[str, str]] = {
    "stream_bytes_from_peers": ("weightpub_stream_bytes_from_peers",
                                "Chunk bytes asked on peers' stream ports and verified"),
    "stream_chunks_from_peers": ("weightpub_stream_chunks_from_peers",
                                 "Chunks asked on peers' stream ports and verified"),
    "stream_bytes_sent": ("weightpub_peer_stream_sent_bytes",
                          "Chunk bytes this member sent its peers on its own stream port"),
    "stream_chunks_sent": ("weightpub_peer_stream_sent_chunks",
                           "Chunks this member sent its peers on its own stream port"),
    "stream_tokens_issued": ("weightpub_peer_stream_tokens_issued",
                             "One-time stream tokens this member handed its peers"),
    "stream_refused": ("weightpub_peer_stream_refused",
                       "Connections to this member's stream port refused (bad hello/token)"),
    "stream_cut": ("weightpub_peer_stream_cut",
                   "Connections to this member's stream port it cut (stalled, bad request)"),
    "stream_unavailable": ("weightpub_peer_stream_unavailable",
                           "Requests on this member's stream port answered UNAVAILABLE"),
    "stream_slice_bytes_sent": ("weightpub_peer_stream_slice_sent_bytes",
                                "Planned bytes this sliced member sent on its stream port"),
    "stream_slice_bytes_gathered": ("weightpub_peer_stream_slice_gathered_bytes",
                                    "Of those, bytes copied first (strided short rows)"),
}

#: name -> (help, bucket upper bounds in seconds)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "transfer_seconds": (
        "Time from a version's manifest to the version staged and verified on this node",
        (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)),
    "commit_pause_seconds": (
        "Time the engine's step loop was blocked by a commit",
        (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)),
    "apply_seconds": (
        "Time to turn staged tensors into the model's weights (prepare or reload)",
        (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)),
}


class FixedHistogram:
    """Bucket counts for known upper bounds (the last bucket is +Inf)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_json(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.sum}


class RankMetrics:
    """One worker rank's counters and histograms (thread-safe; updated on events)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.histograms = {name: FixedHistogram(bounds)
                           for name, (_, bounds) in HISTOGRAMS.items()}
        self.commits = 0
        self.failures: dict[str, int] = {}

    def observe(self, histogram: str, seconds: float) -> None:
        with self._lock:
            self.histograms[histogram].observe(seconds)

    def committed(self, pause_seconds: float) -> None:
        with self._lock:
            self.commits += 1
            self.histograms["commit_pause_seconds"].observe(pause_seconds)

    def failed(self, reason: str) -> None:
        with self._lock:
            count_bounded(self.failures, reason, 32)  # a bounded label set

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "commits": self.commits,
                "failures": dict(self.failures),
                "histograms": {n: h.to_json() for n, h in self.histograms.items()},
            }


def peer_nixl_counters(source: dict[str, Any]) -> dict[str, Any]:
    """A subscriber status's peers-over-NIXL counters, for the status file: the
    ``PEER_NIXL_COUNTERS`` it has, and ``nixl_unoffered`` (versions asked of it and not
    offered, by cause); empty without peer sharing."""
    peers = source.get("peers")
    if not isinstance(peers, dict):
        return {}
    out: dict[str, Any] = {key: peers[key] for key in PEER_NIXL_COUNTERS
                           if _number(peers.get(key)) is not None}
    if isinstance(peers.get("nixl_unoffered"), dict):
        out["nixl_unoffered"] = dict(peers["nixl_unoffered"])
    return out


def peer_stream_counters(source: dict[str, Any]) -> dict[str, Any]:
    """A subscriber status's peers-over-the-stream counters, for the status file: the
    ``PEER_STREAM_COUNTERS`` it has (asked and served), ``fallback_causes`` (peer chunks
    given back to frames, by cause) and ``cpu_s`` (its port's CPU, by part); empty
    without peer sharing."""
    peers = source.get("peers")
    if not isinstance(peers, dict):
        return {}
    served = peers["stream_served"] if isinstance(peers.get("stream_served"), dict) else {}
    both = {**served, **peers}
    out: dict[str, Any] = {key: both[key] for key in PEER_STREAM_COUNTERS
                           if _number(both.get(key)) is not None}
    if isinstance(peers.get("stream_fallback_causes"), dict):
        out["fallback_causes"] = dict(peers["stream_fallback_causes"])
    if isinstance(served.get("stream_cpu_s"), dict):
        out["cpu_s"] = dict(served["stream_cpu_s"])
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _add_by_key(family: CounterMetricFamily, label: list[str], counts: Any,
                width: int = 32) -> None:
    """One series per key of a status file's ``{cause: count}`` (None: none), the key
    cut to ``width`` characters (a bounded label); counts that are not numbers skipped."""
    for key, count in sorted((counts or {}).items()):
        if _number(count) is not None:
            family.add_metric([*label, str(key)[:width]], float(count))


def _add_numbers(families: dict[str, Any], label: list[str], source: Any) -> None:
    """One series per family whose key the status section has as a number."""
    section = source if isinstance(source, dict) else {}
    for key, family in families.items():
        value = _number(section.get(key))
        if value is not None:
            family.add_metric(label, value)


def _section(state: dict[str, Any], name: str) -> dict[str, Any]:
    """A status file's sub-dict (``{}`` when absent or not a dict)."""
    value = state.get(name)
    return value if isinstance(value, dict) else {}


class ReplicaCollector(Collector):
    """Reads every rank's status file at scrape time and yields the metric families."""

    GAUGES = {
        "applied_version": "Weight version this rank serves (0 before the first commit)",
        "staged_version": "Newest complete, verified version staged for this rank",
        "publisher_latest_version": "Newest version the publisher has announced",
        "versions_behind": "Versions between the publisher's newest and the applied one",
        "prepare_budget_bytes": "Bytes this rank's prepared shadows may hold (absent: "
                                "unbounded)",
        "prepare_held_bytes": "Bytes this rank's prepared shadows hold now",
        "receive_planned_fraction": "Share of a version this rank's slice plan needs "
                                    "(absent: no plan, whole versions)",
        "received_fraction": "Bytes this rank received for its applied version, as a share "
                             "of that version (absent: unknown, or a node-staging follower)",
        "stream_scratch_bytes": "Bytes the stream path's landing scratch holds now (in the "
                                "staging budget; stream=True)",
    }

    #: status file key -> (counter name, help); a series only where the key is
    COUNTERS = {
        "stream_landing_refused": (
            "weightpub_stream_landing_refused",
            "Stream slices read in place for want of room to land them (slower, the same "
            "bytes)"),
        "versions_abandoned": ("weightpub_versions_abandoned",
                               "Versions the subscription gave up (the newest, and why: the "
                               "worker's status)"),
    }

    #: ``early_sums`` status key -> ``what`` label of ``weightpub_early_sums``
    EARLY_SUMS = {"versions": "versions", "replies": "replies", "held": "chunks_held"}

    def __init__(self, board: StatusBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        ranks = sorted(self.board.read().items())
        gauges = {name: GaugeMetricFamily(f"weightpub_{name}", text, labels=["rank"])
                  for name, text in self.GAUGES.items()}
        received = CounterMetricFamily("weightpub_received_bytes",
                                       "Bytes received on the data path", labels=["rank"])
        stream_received = CounterMetricFamily(
            "weightpub_stream_received_bytes",
            "Bytes of those received on the publisher's plain-TCP stream port (stream=True)",
            labels=["rank"])
        commits = CounterMetricFamily("weightpub_commits", "Versions committed",
                                      labels=["rank"])
        failures = CounterMetricFamily("weightpub_failures",
                                       "Versions or transfers that failed, by reason",
                                       labels=["rank", "reason"])
        fallbacks = CounterMetricFamily(
            "weightpub_collective_fallbacks",
            "Versions held back for the collective path but fetched over ZeroMQ, by cause",
            labels=["rank", "cause"])
        nixl_fallbacks = CounterMetricFamily(
            "weightpub_nixl_fallbacks",
            "Versions (checksum: chunks) offered over NIXL but fetched over ZeroMQ, by cause",
            labels=["rank", "cause"])
        stream_fallbacks = CounterMetricFamily(
            "weightpub_stream_fallbacks",
            "Versions (checksum: chunks) offered on the stream port but fetched over ZeroMQ, "
            "by cause", labels=["rank", "cause"])
        peer_nixl = {key: CounterMetricFamily(name, text, labels=["rank"])
                     for key, (name, text) in PEER_NIXL_COUNTERS.items()}
        peer_stream = {key: CounterMetricFamily(name, text, labels=["rank"])
                       for key, (name, text) in PEER_STREAM_COUNTERS.items()}
        peer_stream_fallbacks = CounterMetricFamily(
            "weightpub_peer_stream_fallbacks",
            "Peer chunks planned on a peer's stream port but asked as frames, by cause",
            labels=["rank", "cause"])
        peer_stream_cpu = CounterMetricFamily(
            "weightpub_peer_stream_cpu_seconds",
            "CPU this member's stream port spent serving peers, by part (sends, pump)",
            labels=["rank", "part"])
        counters = {key: CounterMetricFamily(name, text, labels=["rank"])
                    for key, (name, text) in self.COUNTERS.items()}
        early_sums = CounterMetricFamily(
            "weightpub_early_sums",
            "Versions announced before their checksums (announce_early), sum replies taken, "
            "chunks whose bytes waited for their sum", labels=["rank", "what"])
        peer_unoffered = CounterMetricFamily(
            "weightpub_peer_nixl_unoffered",
            "peer_nixl questions this member answered without an offer, by cause",
            labels=["rank", "cause"])
        receive_mode = GaugeMetricFamily(
            "weightpub_receive_mode_info",
            "How this rank receives versions (1): slices, node (staging) or rank (whole)",
            labels=["rank", "mode"])
        path = GaugeMetricFamily("weightpub_data_path_info",
                                 "The data path that delivered the applied version (1)",
                                 labels=["rank", "path"])
        histograms = {name: HistogramMetricFamily(f"weightpub_{name}", text, labels=["rank"])
                      for name, (text, _) in HISTOGRAMS.items()}
        for rank, state in ranks:
            label = [str(rank)]
            applied = _number(state.get("applied_version")) or 0.0
            latest = _number(state.get("publisher_latest_version"))
            budget = state.get("prepare_budget") or {}
            receive: dict[str, Any] = state["receive"] \
                if isinstance(state.get("receive"), dict) else {}
            cost: dict[str, Any] = receive["received"] \
                if isinstance(receive.get("received"), dict) else {}
            values = {
                "applied_version": applied,
                "staged_version": _number(state.get("staged_version")) or 0.0,
                "publisher_latest_version": latest,
                "versions_behind": None if latest is None else max(0.0, latest - applied),
                "prepare_budget_bytes": _number(budget.get("limit_bytes")),
                "prepare_held_bytes": _number(budget.get("held_bytes")),
                "receive_planned_fraction": _number(receive.get("planned_fraction")),
                "received_fraction": _number(cost.get("fraction")),
                "stream_scratch_bytes": _number(state.get("stream_scratch_bytes")),
            }
            for name, value in values.items():
                if value is not None:
                    gauges[name].add_metric(label, value)
            received.add_metric(label, _number(state.get("received_bytes")) or 0.0)
            stream_bytes = _number(state.get("stream_received_bytes"))
            if stream_bytes is not None:
                stream_received.add_metric(label, stream_bytes)
            metrics = state.get("metrics") or {}
            commits.add_metric(label, _number(metrics.get("commits")) or 0.0)
            _add_by_key(failures, label, metrics.get("failures"), width=64)
            _add_by_key(fallbacks, label, state.get("collective_fallbacks"))
            _add_by_key(nixl_fallbacks, label, state.get("nixl_fallbacks"))
            _add_by_key(stream_fallbacks, label, state.get("stream_fallbacks"))
            peer = _section(state, "peer_nixl")
            _add_numbers(peer_nixl, label, peer)
            _add_numbers(counters, label, state)
            sums = _section(state, "early_sums")
            for key, what in self.EARLY_SUMS.items():
                value = _number(sums.get(key))
                if value is not None:
                    early_sums.add_metric([*label, what], value)
            _add_by_key(peer_unoffered, label, peer.get("nixl_unoffered"))
            streamed = _section(state, "peer_stream")
            _add_numbers(peer_stream, label, streamed)
            _add_by_key(peer_stream_fallbacks, label, streamed.get("fallback_causes"))
            _add_by_key(peer_stream_cpu, label, streamed.get("cpu_s"))
            if isinstance(receive.get("mode"), str):
                receive_mode.add_metric([*label, receive["mode"][:16]], 1.0)
            if isinstance(state.get("data_path"), str):
                path.add_metric([*label, state["data_path"][:16]], 1.0)
            for name, (_, bounds) in HISTOGRAMS.items():
                data = (metrics.get("histograms") or {}).get(name) or {}
                counts = data.get("counts")
                if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
                    continue
                cumulative, buckets = 0.0, []
                for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                    cumulative += _number(count) or 0.0
                    buckets.append((bound, cumulative))
                histograms[name].add_metric(label, buckets, _number(data.get("sum")) or 0.0)
        yield from gauges.values()
        yield received
        yield stream_received
        yield commits
        yield failures
        yield fallbacks
        yield nixl_fallbacks
        yield stream_fallbacks
        yield from peer_nixl.values()
        yield peer_unoffered
        yield from peer_stream.values()
        yield peer_stream_fallbacks
        yield peer_stream_cpu
        yield from counters.values()
        yield early_sums
        yield receive_mode
        yield path
        yield from histograms.values()
