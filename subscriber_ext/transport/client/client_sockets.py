"""A ``SyncClient``'s two sockets to its publisher, and what their handshakes say.

Split from ``sync_client.py``: socket hygiene is a list of options each with a
reason (frame-size caps before anything is read, no queueing to a peer that is
not connected, a handshake given up after ``request_timeout``), and a refused
CURVE handshake must become ``last_error`` at once rather than a silent stall.
The sockets also notice a DEALER that stopped answering (``reply_watch.py``)
and dial it anew.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from subscriber_ext.transport.client.client_report import ClientReport
from subscriber_ext.transport.client.reply_watch import SILENT_TIMEOUTS, ReplyWatch
from weightpub_wire import protocol as wire
from weightpub_wire.errors import TransportError
from weightpub_wire.monitor import describe_handshake_failure, open_monitor, read_events
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["ClientSockets"]


class ClientSockets:
    """The DEALER to the publisher's ROUTER, the SUB to its PUB, the DEALER's monitor."""

    def __init__(self, ctx: zmq.Context, endpoint: str, request_timeout: float,
                 limits: wire.Limits, hooks: list[Callable[..., None]],
                 report: ClientReport) -> None:
        self.endpoint = endpoint
        self.request_timeout = request_timeout
        self.pub_endpoint = ""  # the PUB address the ROUTER named (connected)
        self.replies = ReplyWatch()  # a DEALER that stopped answering
        self.handshake_failures = 0
        self._report = report
        self.dealer, self.sub, self.monitor = _open(ctx, endpoint, request_timeout, limits,
                                                    hooks)

    def close(self) -> None:
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)
        self.sub.close(linger=0)

    def send(self, message: Any) -> bool:
        """One control message to the publisher; False when not connected yet."""
        try:
            self.dealer.send(wire.encode(message), zmq.NOBLOCK)
            self.replies.sent(time.monotonic(), queued=True)
            return True
        except zmq.Again:  # no pipe (ended by a protocol error) or full: retried later
            self.replies.sent(time.monotonic(), queued=False)
            return False

    def heard(self, now: float) -> None:
        """A frame came back on the DEALER."""
        self.replies.heard(now)

    def follow_pub(self, pub: str) -> None:
        """Subscribe at the PUB address the ROUTER named (moving off the old one)."""
        if pub == self.pub_endpoint:
            return
        if self.pub_endpoint:
            self.sub.disconnect(self.pub_endpoint)
        self.sub.connect(pub)
        self.pub_endpoint = pub

    def on_handshake_events(self) -> None:
        """Handshake events of the DEALER: a refusal becomes ``last_error`` at once."""
        report = self._report
        for event in read_events(self.monitor):
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if isinstance(report.error, TransportError):
                    report.resolved(report.error)  # the refusal is over (the key was allowed)
                continue
            why = describe_handshake_failure(event, client=True)
            if why is not None:
                self.handshake_failures += 1
                report.problem(TransportError(why))
                report.warn.warning("handshake", why)

    def watch_replies(self, now: float, *, asking: bool) -> None:
        """Dial the ROUTER anew when the client has waited ``SILENT_TIMEOUTS`` request
        timeouts for a reply that cannot come (``reply_watch.py``); ``asking``: requests
        are in flight or the client is not in sync. What was in flight times out and is
        asked again on the new connection."""
        if not (asking or self.replies.refused):
            self.replies.idle()
            return
        timeout = self.request_timeout
        if not self.replies.stalled(now, timeout):
            return
        self._report.warn.warning(
            "redial", f"no reply from {self.endpoint} for {SILENT_TIMEOUTS * timeout:.0f}s "
                      "while waiting for one; dialling again")
        _redial(self.dealer, self.endpoint)

    def redial_sub(self) -> None:
        """Dial the PUB endpoint anew (after the publisher went silent on it)."""
        if self.pub_endpoint:
            _redial(self.sub, self.pub_endpoint)


def _open(ctx: zmq.Context, endpoint: str, request_timeout: float, limits: wire.Limits,
          hooks: list[Callable[..., None]]) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
    """(DEALER connected to ``endpoint``, SUB not yet connected, the DEALER's monitor)."""
    dealer = ctx.socket(zmq.DEALER)
    sub = ctx.socket(zmq.SUB)
    for sock in (dealer, sub):
        configure_socket(sock, heartbeat_interval=1.0)
        for hook in hooks:
            hook(sock, server=False)
    # no IMMEDIATE: with it, libzmq 4.3.5 ends a dropped connection's pipe at once, with
    # the rest of a chunk reply whose header frame was already read, and then aborts
    # the process on the next frame (zmq_recv; seen in the kill matrix, about 1 run
    # in 4). Requests sent while disconnected wait in the pipe (bounded by SNDHWM);
    # a new publisher instance refuses the stale ones and they are asked again.
    dealer.setsockopt(zmq.RCVHWM, 0)
    # a refused or silent handshake is given up (and reported) after request_timeout
    dealer.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(request_timeout * 1000)))
    # no frame larger than a chunk (or a control message) is ever accepted off the wire
    dealer.setsockopt(zmq.MAXMSGSIZE, max(wire.MAX_CHUNK_SIZE + wire.CHUNK_HEADER_BYTES,
                                          limits.max_control_bytes))
    sub.setsockopt(zmq.MAXMSGSIZE, limits.max_control_bytes)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = open_monitor(dealer, zmq.EVENT_HANDSHAKE_FAILED_AUTH
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    connect(dealer, endpoint)
    return dealer, sub, monitor


def _redial(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError:
        pass  # ZeroMQ had already dropped it: connecting again is all there is to do
    connect(sock, endpoint)
