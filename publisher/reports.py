"""The back-channel table: each subscriber's last report, bound to who sent it, bounded.

A report is filed under ``(client, subscriber_id)`` where ``client`` is the
CURVE public key its connection authenticated with (``User-Id``), or the peer's
address without CURVE. So a stranger cannot overwrite another client's rows;
with an allow-list it cannot report at all. Every resource is bounded: rows per
client, rows in total (expired rows make room first), the text kept per row,
and the rows a status reply carries.

``counts_for`` is the rule ``wait_for_subscribers`` applies: only reports about
this publisher instance's versions, and no version it has not announced (a
report of version 2**63-1 is a lie, not a quorum).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgspec

from weightpub_wire import protocol as wire

__all__ = ["ReportLimits", "ReportTable"]


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
        self._lock = threading.Lock()

    def record(self, report: wire.Report, client: str, now: float,
               client_key: str | None) -> str | None:
        """File a report; returns why it was refused, or None."""
        report = msgspec.structs.replace(report, client_key=client_key)
        key = (client, report.subscriber_id)
        with self._lock:
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
        return None

    def _expire_locked(self, now: float) -> None:
        cutoff = now - self.limits.ttl
        for key, (_, seen) in list(self._rows.items()):
            if seen < cutoff:
                del self._rows[key]
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
