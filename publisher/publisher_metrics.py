"""Prometheus metrics of a publisher, on an optional HTTP port of its own.

``WeightPublisher(..., metrics_port=P)`` (YAML ``metrics_port``) serves
``/metrics`` from a registry of its own, so several publishers in one process
do not collide. Values are read from the publisher at scrape time (no work on
the publish path). ``metrics_host`` defaults to loopback: fleet reports name
hosts, so exposing them is a deliberate choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from threading import Thread
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from publisher.store.nixl_export import UNOFFERED_CAUSES, WORDS_KINDS
from weightpub_wire.errors import TransportError
from weightpub_wire.protocol import (
    PeerFigures,
    PeerNixlFigures,
    PeerStreamFigures,
    Report,
    peer_total,
)

__all__ = ["MetricsServer", "PublisherCollector", "PublisherFigures"]


@dataclass(frozen=True, slots=True)
class PublisherFigures:
    """What the collector reads from a publisher at scrape time."""

    latest_version: int
    versions_published: int
    served_bytes: int
    fleet: list[Report]
    served_delta_bytes: int = 0  # the part of ``served_bytes`` sent as deltas
    #: the stream port's counters (``StreamServer.status()``), None when ``stream`` is off
    stream: dict[str, int] | None = None
    #: the NIXL offers (``NixlExport.status()``), None when ``nixl`` is off
    nixl: dict[str, object] | None = None


class PublisherCollector(Collector):
    """``weightpub_publisher_*`` families from a ``PublisherFigures`` source."""

    def __init__(self, figures: Callable[[], PublisherFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        f = self._figures()
        yield GaugeMetricFamily("weightpub_publisher_latest_version",
                                "Newest version announced to subscribers", f.latest_version)
        yield CounterMetricFamily("weightpub_publisher_versions_published",
                                  "Versions published by this publisher", f.versions_published)
        yield CounterMetricFamily("weightpub_publisher_served_bytes",
                                  "Bytes served on the data path", f.served_bytes)
        yield CounterMetricFamily("weightpub_publisher_served_delta_bytes",
                                  "Bytes of those served as deltas", f.served_delta_bytes)
        states = {"current": 0, "behind": 0, "error": 0}
        lag = 0
        for report in f.fleet:
            behind = max(0, f.latest_version - report.applied_version)
            lag = max(lag, behind)
            state = "error" if report.last_error else ("behind" if behind else "current")
            states[state] += 1
        family = GaugeMetricFamily("weightpub_publisher_subscribers",
                                   "Subscribers seen recently, by state", labels=["state"])
        for state, count in states.items():
            family.add_metric([state], count)
        yield family
        yield GaugeMetricFamily("weightpub_publisher_slowest_subscriber_lag_versions",
                                "Versions the slowest subscriber's applied version is behind",
                                lag)
        yield from _peer_families(f.fleet)
        if f.stream is not None:
            yield from _stream_families(f.stream)
        if f.nixl is not None:
            yield from _nixl_families(f.nixl)


#: the fleet's peer figures: ``Report`` field -> its kind, the path its help names, and
#: each figures field's gauge (after ``weightpub_publisher_fleet_``; the causes field's
#: is labelled ``cause``)
_PEER_GAUGES: dict[str, tuple[type[PeerFigures], str, dict[str, str]]] = {
    "peer_nixl": (PeerNixlFigures, "over NIXL (READ)", {  # issue 31
        "bytes_from_peers": "nixl_bytes_from_peers", "chunks_from_peers": "nixl_chunks_from_peers",
        "offers": "peer_nixl_offers", "unoffered": "peer_nixl_unoffered"}),
    "peer_stream": (PeerStreamFigures, "on peers' stream ports", {  # docs/peer-stream.md
        "bytes_from_peers": "stream_bytes_from_peers",
        "chunks_from_peers": "stream_chunks_from_peers", "bytes_served": "peer_stream_sent_bytes",
        "chunks_served": "peer_stream_sent_chunks", "fallbacks": "peer_stream_fallbacks"}),
}
_PEER_HELP = {
    "bytes_from_peers": "Chunk bytes members took from peers {path}",
    "chunks_from_peers": "Chunks members took from peers {path}",
    "offers": "Peers' peer_nixl questions members answered with an offer",
    "unoffered": "Peers' peer_nixl questions members answered without an offer, by cause "
                 "(frames: the version came as frames; sliced; budget...)",
    "bytes_served": "Chunk bytes members' own stream ports sent",
    "chunks_served": "Chunks members' own stream ports sent",
    "fallbacks": "Chunks members asked of a peer's stream and then of frames, by cause "
                 "(refused, no_answer, closed, checksum...)",
}


def _peer_families(fleet: list[Report]) -> Iterator[Metric]:
    """Peers over NIXL and over the stream, over the fleet: the members' counters summed
    over the reports seen recently (gauges: a row that expires takes its counts with it;
    0 where no member reports them)."""
    for field, (kind, path, gauges) in _PEER_GAUGES.items():
        total = peer_total(getattr(report, field) for report in fleet) or kind()
        for name, metric in gauges.items():
            help_text = (_PEER_HELP[name].format(path=path)
                         + ", summed over the subscribers seen recently")
            if name != kind.CAUSES:
                yield GaugeMetricFamily(f"weightpub_publisher_fleet_{metric}", help_text,
                                        getattr(total, name))
                continue
            family = GaugeMetricFamily(f"weightpub_publisher_fleet_{metric}", help_text,
                                       labels=["cause"])
            for cause, count in total.causes():
                family.add_metric([cause], count)
            yield family


def _nixl_families(nixl: dict[str, object]) -> Iterator[Metric]:
    """The NIXL offers (``nixl=True``, issue 31): whether on, buffers and bytes registered,
    offers made, versions announced without one by cause (every cause, 0 included)."""
    yield GaugeMetricFamily("weightpub_publisher_nixl_on",
                            "1 while versions are offered for one-sided NIXL reads, 0 when "
                            "the path is off (NIXL missing, a registration failed)",
                            1 if nixl["on"] else 0)
    yield CounterMetricFamily("weightpub_publisher_nixl_registrations",
                              "Snapshot buffers registered with NIXL (each pool buffer once)",
                              _int(nixl["registrations"]))
    yield GaugeMetricFamily("weightpub_publisher_nixl_registered_bytes",
                            "Bytes of snapshot buffers registered with NIXL now",
                            _int(nixl["registered_bytes"]))
    yield CounterMetricFamily("weightpub_publisher_nixl_offers",
                              "Manifests announced with a NIXL offer", _int(nixl["offers"]))
    unoffered = nixl["unoffered"]
    assert isinstance(unoffered, dict)
    family = CounterMetricFamily(
        "weightpub_publisher_nixl_unoffered",
        "Versions announced without a NIXL offer, by cause: off (NIXL does not run here), "
        "unregistered (the bytes are not in a registered buffer), copy (the copy was not "
        "complete)", labels=["cause"])
    for cause in dict.fromkeys((*UNOFFERED_CAUSES, *unoffered)):
        family.add_metric([cause], _int(unoffered.get(cause, 0)))
    yield family
    refused = nixl.get("words_refused", {})
    assert isinstance(refused, dict)
    family = CounterMetricFamily(
        "weightpub_publisher_nixl_words_refused",
        "Buffers whose words UCX refused to register (once per buffer; their offers went "
        "without them), by kind: claims (claims words), ready (readiness map)",
        labels=["kind"])
    for kind in dict.fromkeys((*WORDS_KINDS, *refused)):
        family.add_metric([kind], _int(refused.get(kind, 0)))
    yield family


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _stream_families(stream: dict[str, int]) -> Iterator[Metric]:
    """The plain-TCP stream port (``stream=True``, issue 29): bytes and chunks sent there,
    connections by outcome, tokens by outcome, connections open now."""
    yield CounterMetricFamily("weightpub_publisher_stream_bytes",
                              "Chunk bytes sent on the plain-TCP stream port",
                              stream["bytes_sent"])
    yield CounterMetricFamily("weightpub_publisher_stream_chunks",
                              "Chunks sent on the plain-TCP stream port", stream["chunks_sent"])
    yield CounterMetricFamily("weightpub_publisher_stream_slice_bytes",
                              "Of the stream bytes, a sliced subscriber's planned bytes",
                              stream["slice_bytes_sent"])
    yield GaugeMetricFamily("weightpub_publisher_stream_open_connections",
                            "Connections to the stream port open now", stream["connections"])
    connections = CounterMetricFamily(
        "weightpub_publisher_stream_connections",
        "Connections to the stream port by outcome: accepted (a good token), refused (a bad, "
        "used or expired token), turned_away (max_connections), cut (a bad hello or request, "
        "stalled, a revoked key)", labels=["outcome"])
    for outcome in ("accepted", "refused", "turned_away", "cut"):
        connections.add_metric([outcome], stream[outcome])
    yield connections
    tokens = CounterMetricFamily(
        "weightpub_publisher_stream_tokens",
        "Stream tokens asked over the ROUTER, by outcome: issued, or denied (too many "
        "outstanding)", labels=["outcome"])
    tokens.add_metric(["issued"], stream["tokens_issued"])
    tokens.add_metric(["denied"], stream["tokens_denied"])
    yield tokens


class MetricsServer:
    """An HTTP ``/metrics`` endpoint for one collector; ``close()`` stops it."""

    def __init__(self, collector: Collector, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise TransportError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self._server: Any = server
        self._thread: Thread = thread
        self.port = int(server.server_port)
        self.host = host

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
