"""What a ``SyncClient`` tells its publisher (the back-channel ``Report``) and ``status()``.

Why one part: every other part meets problems (a bad frame, a refused handshake,
a version given up, a budget refusal) and each must reach the publisher as
``last_error`` soon, without waiting for the next periodic report. They hand the
problem to this part; it keeps the newest one, counts them by class (a fixed,
small set), and says when a report is due (``interval``, or at once after a change).
The applied version and its data path, the replica ranks and the data path of
each recently staged version are reported here too, with what the applied version
cost this subscriber (``VersionBytes``: its payload bytes by source kind; the
report carries their share of the version, ``Report.received_fraction``).

A subscription replaced by another (a rank's slice receiver resubscribing with a new
plan, ``vllm_ext/slice_receiver.py``) hands its applied version, what it cost and the
costs of its recently staged versions to the new one (``carried``/``adopt``): the
applied version is still the one running, and one the old subscription staged may be
applied after the switch. The new client's first instance keeps them when it is the
one they came from.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["ClientReport", "ReportCarry", "VersionBytes", "peer_nixl_figures",
           "peer_stream_figures"]

log = logging.getLogger("weightpub.subscriber")
_KEEP_PATHS = 16  # staged versions whose data path is remembered


def peer_nixl_figures(peers: dict[str, Any] | None) -> wire.PeerNixlFigures | None:
    """The peers-over-NIXL counters of ``status()["peers"]`` for the report, within the
    wire's bounds (``PeerFigures.bounded``); None without peer sharing or where none of
    them ever counted (peers over NIXL run only where the ``nixl`` option is True)."""
    if not peers:
        return None
    unoffered = peers.get("nixl_unoffered") or {}
    if "nixl_bytes_from_peers" not in peers and not peers.get("nixl_offers") and not unoffered:
        return None
    return wire.PeerNixlFigures.bounded(
        {"bytes_from_peers": peers.get("nixl_bytes_from_peers", 0),
         "chunks_from_peers": peers.get("nixl_chunks_from_peers", 0),
         "offers": peers.get("nixl_offers", 0)}, unoffered)


def peer_stream_figures(peers: dict[str, Any] | None) -> wire.PeerStreamFigures | None:
    """The peers-over-the-stream counters of ``status()["peers"]`` for the report (what
    it received on peers' stream ports, what its own port sent, fallbacks by cause),
    within the wire's bounds; None without peer sharing or with neither side of the
    peer stream (the ``stream`` option off)."""
    if not peers:
        return None
    served = peers.get("stream_served") or {}
    if "stream_bytes_from_peers" not in peers and not served:
        return None
    return wire.PeerStreamFigures.bounded(
        {"bytes_from_peers": peers.get("stream_bytes_from_peers", 0),
         "chunks_from_peers": peers.get("stream_chunks_from_peers", 0),
         "bytes_served": served.get("stream_bytes_sent", 0),
         "chunks_served": served.get("stream_chunks_sent", 0)},
        peers.get("stream_fallback_causes") or {})


@dataclass(frozen=True, slots=True)
class VersionBytes:
    """The payload bytes one version cost this subscriber, by source kind
    (``chunk_source.SOURCE_KINDS``), against the version's size."""

    version: int
    version_bytes: int
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def received_bytes(self) -> int:
        return sum(self.by_source.values())

    @property
    def fraction(self) -> float | None:
        """Received bytes as a share of the version (None for an empty version)."""
        if self.version_bytes <= 0:
            return None
        return round(self.received_bytes / self.version_bytes, 4)

    def wire_fraction(self) -> float | None:
        """``fraction`` within the wire's bound (``Report.received_fraction``)."""
        fraction = self.fraction
        return None if fraction is None else min(fraction, wire.MAX_RECEIVED_FRACTION)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "received_bytes": self.received_bytes,
                "version_bytes": self.version_bytes, "fraction": self.fraction,
                "by_source": dict(self.by_source)}


@dataclass(frozen=True, slots=True)
class ReportCarry:
    """What a replaced subscription's report hands to the next one (module text)."""

    instance: str | None  # the publisher instance the versions are of
    applied_version: int
    applied_path: str
    applied_bytes: VersionBytes | None
    staged_paths: dict[int, str]
    staged_bytes: dict[int, VersionBytes]


class ClientReport:
    """The newest problem, counts of problems, the applied version; when to report."""

    def __init__(self, subscriber_id: str, interval: float) -> None:
        self.subscriber_id = subscriber_id
        self.interval = interval
        self.error: WeightPubError | None = None  # the newest problem, as our exception
        self.failures: dict[str, int] = {}  # problems by error class
        # the newest version given up and why: kept when a later problem (a reconnect's
        # handshake, say) replaces ``last_error``
        self.abandoned: dict[str, Any] | None = None
        self.abandoned_count = 0  # versions given up (a counter on the replica's /metrics)
        self.bad_messages = 0
        self.warn = RateLimitedLog(log)
        self.ranks: tuple[int, ...] = ()  # replica ranks served
        self.applied_version = 0
        self.applied_path = ""  # data path of the applied version
        self.staged_paths: OrderedDict[int, str] = OrderedDict()  # newest few versions
        self.staged_bytes: OrderedDict[int, VersionBytes] = OrderedDict()  # the same few
        self.applied_bytes: VersionBytes | None = None  # what the applied version cost
        self._adopted: str | None = None  # the instance of what ``adopt`` brought
        self._dirty = True
        self._next_at = 0.0

    @property
    def last_error(self) -> str | None:
        """``"<ErrorClass>: <what>"`` of the newest problem, or None."""
        if self.error is None:
            return None
        return f"{type(self.error).__name__}: {self.error}"[: wire.MAX_ERROR_CHARS]

    # -- what changed ------------------------------------------------------------------------
    def changed(self) -> None:
        """Something reported changed: report at once rather than at the next interval."""
        self._dirty = True

    def problem(self, error: WeightPubError) -> None:
        """The newest problem (``last_error``), reported at once."""
        self.error = error
        self._dirty = True

    def resolved(self, error: WeightPubError) -> None:
        """``error`` is over: clear it, unless a newer problem replaced it already."""
        if self.error is error:
            self.error = None
            self._dirty = True

    def abandon(self, version: int | None, error: WeightPubError) -> None:
        """A version given up: counted, named in ``last_error`` and kept in ``abandoned``."""
        self.count_failure(error)
        self.abandoned_count += 1
        self.abandoned = {"version": version,
                          "why": f"{type(error).__name__}: {error}"[: wire.MAX_ERROR_CHARS]}
        self.problem(error)

    def count_failure(self, error: WeightPubError) -> None:
        name = type(error).__name__
        self.failures[name] = self.failures.get(name, 0) + 1

    def bad(self, why: WeightPubError) -> None:
        """A message that could not be used: counted, reported, logged (rate-limited)."""
        self.count_failure(why)
        self.bad_messages += 1
        self.problem(why)
        self.warn.warning(type(why).__name__, str(why))

    def set_ranks(self, ranks: tuple[int, ...]) -> None:
        self.ranks = tuple(sorted(ranks))
        self._dirty = True

    def staged(self, version: int, data_path: str, cost: VersionBytes | None = None) -> None:
        """``version`` is staged, having come by ``data_path`` at ``cost`` (both reported
        once applied)."""
        self.staged_paths[version] = data_path
        while len(self.staged_paths) > _KEEP_PATHS:
            self.staged_paths.popitem(last=False)
        self.staged_bytes.pop(version, None)
        if cost is not None:
            self.staged_bytes[version] = cost
            while len(self.staged_bytes) > _KEEP_PATHS:
                self.staged_bytes.popitem(last=False)
        self._dirty = True

    def mark_applied(self, version: int, error: WeightPubError | None = None) -> None:
        """``version`` 0 leaves the applied version as it is (e.g. to report an error)."""
        if version:
            if version != self.applied_version:
                self.applied_bytes = self.staged_bytes.get(version)
            self.applied_version = version
            self.applied_path = self.staged_paths.get(version, self.applied_path)
        if error is not None:
            self.error = error
        self._dirty = True

    def new_instance(self, instance: str | None = None) -> None:
        """Another publisher instance: a version applied from the old one means nothing
        (unless ``instance`` is the one an adopted record is of: then it is kept)."""
        adopted, self._adopted = self._adopted, None
        if instance is not None and instance == adopted:
            return
        self.applied_version = 0
        self.applied_bytes = None
        self._dirty = True

    def carried(self, instance: str | None) -> ReportCarry:
        """What the next subscription should know of this one's versions (``adopt``)."""
        return ReportCarry(instance, self.applied_version, self.applied_path,
                           self.applied_bytes, dict(self.staged_paths),
                           dict(self.staged_bytes))

    def adopt(self, carry: ReportCarry, applied: int | None = None) -> None:
        """Take over a replaced subscription's record: its staged versions' paths and
        costs this one lacks, its applied version unless one was applied here since,
        then ``applied`` (the newest version applied, told after the switch) if newer."""
        for version, path in carry.staged_paths.items():
            self.staged_paths.setdefault(version, path)
        for version, cost in carry.staged_bytes.items():
            self.staged_bytes.setdefault(version, cost)
        # oldest first (``staged`` drops from the front), the newest few
        self.staged_paths = OrderedDict(sorted(self.staged_paths.items())[-_KEEP_PATHS:])
        self.staged_bytes = OrderedDict(sorted(self.staged_bytes.items())[-_KEEP_PATHS:])
        if not self.applied_version and carry.applied_version:
            self.applied_version = carry.applied_version
            self.applied_path = carry.applied_path
            self.applied_bytes = carry.applied_bytes
        elif self.applied_bytes is None and self.applied_version:
            # told here before the record came: its cost is in the record
            self.applied_bytes = self.staged_bytes.get(self.applied_version)
            self.applied_path = self.applied_path or \
                self.staged_paths.get(self.applied_version, "")
        if applied and applied > self.applied_version:
            self.mark_applied(applied)
        if carry.instance is not None and self.applied_version:
            self._adopted = carry.instance
        self._dirty = True

    # -- sending -----------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return now >= self._next_at or self._dirty

    def message(self, staged_version: int, publisher_id: str | None,
                peers: dict[str, Any] | None = None) -> wire.Report:
        """The report; ``peers``: the member's ``status()["peers"]`` (None: no peer
        sharing), whose peers-over-NIXL and over-the-stream counters it carries."""
        return wire.Report(subscriber_id=self.subscriber_id, staged_version=staged_version,
                           applied_version=self.applied_version, last_error=self.last_error,
                           publisher_id=publisher_id,
                           ranks=self.ranks[: wire.MAX_REPORTED_RANKS],
                           data_path=self.applied_path,
                           received_fraction=None if self.applied_bytes is None
                           else self.applied_bytes.wire_fraction(),
                           peer_nixl=peer_nixl_figures(peers),
                           peer_stream=peer_stream_figures(peers))

    def sent(self, now: float) -> None:
        self._dirty = False
        self._next_at = now + self.interval
