"""The back-channel table: each subscriber's last report, bound to who sent it, bounded.

A report is filed under ``(client, subscriber_id)`` where ``client`` is the
CURVE public key its connection authenticated with (``User-Id``), or the peer's
address without CURVE. So a stranger cannot overwrite another client's rows;
with an allow-list it cannot report at all. Under CURVE a subscriber id also
belongs to the key that first reported it for as long as its row lives: another
key's report under that id is refused, not filed as a second row. Every resource
is bounded: rows per client, rows in total (expired rows make room first), the
text kept per row, and the rows a status reply carries.

``counts_for`` is the rule ``wait_for_subscribers`` applies: only reports about
this publisher instance's versions, and no version it has not announced (a
report of version 2**63-1 is a lie, not a quorum). ``reporters`` counts who
stands behind those reports: under CURVE one per authenticated key, so one key
over many connections (or many ids) is one subscriber; without CURVE nothing is
authenticated and it counts ids, which any host that reaches the endpoint can
invent (``UNAUTHENTICATED_QUORUM``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgspec

from weightpub_wire import protocol as wire

__all__ = ["UNAUTHENTICATED_QUORUM", "ReportLimits", "ReportTable", "counts_for", "reporters"]

UNAUTHENTICATED_QUORUM = (
    "wait_for_subscribers without CURVE counts subscriber ids that nobody authenticated: any "
    "host that reaches the ROUTER can report any id and version and satisfy it; use "
    "curve_secret_key_file (and an allow-list) for a quorum you can trust")


@dataclass(frozen=True, slots=True)
class ReportLimits:
    max_reports: int = 4096  # rows in total
    max_reports_per_client: int = 64  # rows one key (or one address, without CURVE) may hold
    ttl: float = 30.0  # a row not refreshed for this long leaves fleet() and status
    max_status_rows: int = 1024  # newest rows in one status reply
    max_status_error_chars: int = 1024  # last_error cut to this in status replies


class ReportTable:
    """Thread-safe: the serving thread writes, ``WeightPublisher.fleet()`` reads."""

    def __init__(self, limits: ReportLimits) -> None:
        self.limits = limits
        self._rows: dict[tuple[str, str], tuple[wire.Report, float]] = {}
        self._per_client: dict[str, int] = {}
        self._owners: dict[str, str] = {}  # CURVE: subscriber id -> the key whose row it is
        self._lock = threading.Lock()

    def record(self, report: wire.Report, client: str, now: float,
               client_key: str | None) -> str | None:
        """File a report; returns why it was refused, or None."""
        report = msgspec.structs.replace(report, client_key=client_key)
        key = (client, report.subscriber_id)
        with self._lock:
            if client_key is not None:
                owner = self._owners.get(report.subscriber_id)
                if owner is not None and owner != client:
                    held = self._rows.get((owner, report.subscriber_id))
                    if held is None or held[1] < now - self.limits.ttl:
                        self._drop_locked((owner, report.subscriber_id))  # it expired: free
                        owner = None
                if owner is not None and owner != client:
                    return (f"subscriber id {report.subscriber_id[:64]!r} belongs to another "
                            f"CURVE key ({owner[:12]}...)")
            if key in self._rows:
                self._rows[key] = (report, now)
                return None
            if self._per_client.get(client, 0) >= self.limits.max_reports_per_client:
                self._expire_locked(now)
                if self._per_client.get(client, 0) >= self.limits.max_reports_per_client:
                    return (f"client {client[:48]} already has "
                            f"{self.limits.max_reports_per_client} subscriber rows")
            if len(self._rows) >= self.limits.max_reports:
                self._expire_locked(now)
                if len(self._rows) >= self.limits.max_reports:
                    return f"{self.limits.max_reports} subscriber rows already tracked"
            self._rows[key] = (report, now)
            self._per_client[client] = self._per_client.get(client, 0) + 1
            if client_key is not None:
                self._owners[report.subscriber_id] = client
        return None

    def _expire_locked(self, now: float) -> None:
        cutoff = now - self.limits.ttl
        for key, (_, seen) in list(self._rows.items()):
            if seen < cutoff:
                self._drop_locked(key)

    def _drop_locked(self, key: tuple[str, str]) -> None:
        if self._owners.get(key[1]) == key[0]:
            del self._owners[key[1]]
        if self._rows.pop(key, None) is None:
            return
        left = self._per_client[key[0]] - 1
        if left:
            self._per_client[key[0]] = left
        else:
            del self._per_client[key[0]]

    def live(self, now: float) -> list[wire.Report]:
        """Reports refreshed within the TTL, newest first."""
        cutoff = now - self.limits.ttl
        with self._lock:
            self._expire_locked(now)
            rows = sorted(self._rows.values(), key=lambda row: row[1], reverse=True)
        return [report for report, seen in rows if seen >= cutoff]

    def for_status(self, now: float) -> tuple[wire.Report, ...]:
        """The newest ``max_status_rows`` live rows, long errors cut (bounded reply size)."""
        cap = self.limits.max_status_error_chars
        out = []
        for report in self.live(now)[: self.limits.max_status_rows]:
            if report.last_error is not None and len(report.last_error) > cap:
                report = msgspec.structs.replace(report, last_error=report.last_error[:cap])
            out.append(report)
        return tuple(out)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


def counts_for(report: wire.Report, *, publisher_id: str, announced: int, version: int,
               applied: bool) -> bool:
    """Whether ``report`` shows ``version`` (or newer) of this instance staged/applied."""
    if report.publisher_id != publisher_id:
        return False
    got = report.applied_version if applied else report.staged_version
    return version <= got <= announced


def reporters(reports: list[wire.Report]) -> int:
    """How many distinct reporters stand behind ``reports``: one per CURVE key (a key on
    many connections, under many ids, is one), else one per subscriber id."""
    return len({("key", r.client_key) if r.client_key is not None else ("id", r.subscriber_id)
                for r in reports})
