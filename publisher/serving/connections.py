"""Per-connection bounds ZeroMQ does not give: bytes held for a peer, connection count.

ZeroMQ keeps the frames of a multipart message in memory until its last frame
arrives, and never shows an incomplete message to the application: a peer that
sends one message that never ends (raw ZMTP, frame after frame with MORE set)
grows the publisher without bound, and ``MAXMSGSIZE`` only bounds each frame.

So the serving thread watches each accepted TCP connection from outside
ZeroMQ: the kernel counts the bytes received on it (``TCP_INFO``), the monitor
gives its file descriptor, and every request delivered from it carries that
descriptor (``SRCFD``). Bytes received since the last delivered request are
bytes ZeroMQ holds for an incomplete message (or protocol chatter: heartbeats,
a few bytes a second). A connection holding more than ``max_held_bytes`` is
cut (``shutdown``; ZeroMQ then frees what it held and a well-behaved peer
reconnects). The same rule bounds subscriber connections to the PUB socket,
where legitimate peers send nothing but a subscription and heartbeats, and a
shard coordinator's collect socket, where ``max_total_held_bytes`` also bounds
the sum over its connections (the largest holder is cut first).

Linux only (``TCP_INFO``); elsewhere only the connection count is bounded.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import zmq

from weightpub_wire.monitor import (
    MonitorEvent,
    close_monitor,
    describe_handshake_failure,
    open_monitor,
    read_events,
)
from weightpub_wire.ratelog import RateLimitedLog
from weightpub_wire.sockets import cut_connection, dup_socket
from weightpub_wire.sockets import peer_name as _peer_name

__all__ = ["ConnectionGuard", "GuardLimits", "cut_connection"]

log = logging.getLogger("weightpub.publisher")
_BYTES_RECEIVED = 128  # offsetof(struct tcp_info, tcpi_bytes_received), Linux >= 4.1


@dataclass(frozen=True, slots=True)
class GuardLimits:
    max_held_bytes: int = 4 << 20  # per connection, received but not delivered
    max_connections: int = 1024  # per socket (ROUTER, PUB)
    check_interval: float = 0.01  # stretched so checks cost at most ~2% of a core
    max_total_held_bytes: int | None = None  # over every connection; None: per connection only


@dataclass(slots=True)
class _Connection:
    kind: str
    peer: str
    baseline: int = 0
    family: int = 0  # AF_INET / AF_INET6 for TCP; 0: not TCP, nothing to measure


def _tcp_family(fd: int) -> int:
    """AF_INET/AF_INET6 if ``fd`` is a TCP socket whose TCP_INFO we can read, else 0."""
    sock = dup_socket(fd)
    if sock is None:
        return 0
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        return int(sock.family) if len(info) >= _BYTES_RECEIVED + 8 else 0
    except (OSError, AttributeError):
        return 0
    finally:
        sock.close()


def _bytes_received(fd: int, family: int) -> int | None:
    """tcpi_bytes_received of ZeroMQ's socket: one getsockopt, no dup (checked often)."""
    try:  # ZeroMQ may have closed it since (its DISCONNECTED event is on its way)
        sock = socket.socket(family, socket.SOCK_STREAM, 0, fileno=fd)
    except OSError:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays ZeroMQ's
    return int(struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0])


class ConnectionGuard:
    """Watches the ROUTER's and PUB's connections; runs on the serving thread."""

    def __init__(self, sockets: dict[str, zmq.Socket], limits: GuardLimits) -> None:
        self.limits = limits
        self._sockets = dict(sockets)
        self._monitors = {kind: open_monitor(sock) for kind, sock in sockets.items()}
        self._conns: dict[int, _Connection] = {}
        self._next_check = 0.0
        self._warn = RateLimitedLog(log)
        self.cut_count = 0
        self.handshake_failures = 0

    @property
    def monitors(self) -> list[zmq.Socket]:
        return list(self._monitors.values())

    def close(self) -> None:
        """Each monitor's events stopped before its PAIR closes (``close_monitor``: else an
        event of a socket still open blocks the context's I/O thread)."""
        for kind, monitor in self._monitors.items():
            close_monitor(self._sockets[kind], monitor)

    def connections(self, kind: str | None = None) -> int:
        return sum(1 for c in self._conns.values() if kind is None or c.kind == kind)

    def fd_peer(self, fd: int) -> str | None:
        conn = self._conns.get(fd)
        return None if conn is None else conn.peer

    def on_events(self, ready: Container[Any] | None = None) -> None:
        """Handle the monitors' connect/disconnect/handshake events; ``ready``: what a
        poll over ``monitors`` found readable (only those are read: a read that finds
        nothing costs ~25 us, and the serving loop wakes ~100 times a second)."""
        for kind, monitor in self._monitors.items():
            if ready is not None and monitor not in ready:
                continue
            for event in read_events(monitor):
                self._on_event(kind, event)

    def _on_event(self, kind: str, event: MonitorEvent) -> None:
        if event.event == zmq.EVENT_ACCEPTED:
            fd = event.value
            conn = _Connection(kind, _peer_name(fd), family=_tcp_family(fd))
            if conn.family:
                conn.baseline = _bytes_received(fd, conn.family) or 0
            if self.connections(kind) >= self.limits.max_connections:
                self._cut(fd, conn, f"{kind} already has {self.limits.max_connections} "
                                    "connections (max_connections)")
                return
            self._conns[fd] = conn
        elif event.event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            self._conns.pop(event.value, None)
        else:
            why = describe_handshake_failure(event, client=False)
            if why is not None:
                self.handshake_failures += 1
                # a refusal (ZAP, wrong key, mechanism) is a WARNING; a peer that just went
                # away mid-handshake (no detail) is routine
                level = logging.INFO if event.event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL \
                    else logging.WARNING
                self._warn.log(level, f"handshake-{kind}-{event.event}", f"{kind}: {why}")

    def delivered(self, fd: int | None) -> None:
        """A complete request arrived on ``fd``: nothing before it is held any more."""
        if fd is None:
            return
        conn = self._conns.get(fd)
        if conn is not None and conn.family:
            received = _bytes_received(fd, conn.family)
            if received is not None:
                conn.baseline = received

    def check(self, now: float | None = None) -> None:
        """Cut connections that hold more than ``max_held_bytes``; cheap, rate-limited."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        started = time.perf_counter()
        holding: list[tuple[int, int, _Connection]] = []
        for fd, conn in list(self._conns.items()):
            if not conn.family:
                continue
            received = _bytes_received(fd, conn.family)
            if received is None:
                continue
            held = received - conn.baseline
            if held > self.limits.max_held_bytes:
                self._cut(fd, conn, f"{held} bytes received but no complete message "
                                    f"(max_held_bytes {self.limits.max_held_bytes})")
            elif held > 0:
                holding.append((held, fd, conn))
        total_bound = self.limits.max_total_held_bytes
        if total_bound is not None:
            total = sum(held for held, _, _ in holding)
            for held, fd, conn in sorted(holding, key=lambda h: -h[0]):
                if total <= total_bound:
                    break
                self._cut(fd, conn, f"{held} bytes received but not delivered, {total} over "
                                    f"every connection (max_total_held_bytes {total_bound})")
                total -= held
        # many connections: check less often, so the guard never costs more than ~2%
        spent = time.perf_counter() - started
        self._next_check = now + max(self.limits.check_interval, 50 * spent)

    def cut(self, fd: int | None, why: str) -> bool:
        """Cut the connection a request came from (a peer over its bounds)."""
        if fd is None:
            return False
        conn = self._conns.get(fd)
        if conn is None:
            return False
        return self._cut(fd, conn, why)

    def _cut(self, fd: int, conn: _Connection, why: str) -> bool:
        done = cut_connection(fd, conn.peer)
        self._conns.pop(fd, None)
        if done:
            self.cut_count += 1
            self._warn.warning(f"cut-{why.split()[0]}",
                               f"cut {conn.kind} connection from {conn.peer or 'a peer'}: {why}")
        return done
