"""A ``SyncClient``'s two sockets to its publisher, and what their handshakes say.

Split from ``sync_client.py``: the DEALER comes from the one factory every chunk
client uses (``weightpub_wire/monitored_dealer.py``: frame-size caps before
anything is read, the CURVE hooks, a handshake given up after ``request_timeout``,
its monitor), and a refused CURVE handshake must become ``last_error`` at once
rather than a silent stall.
The sockets also notice a DEALER that stopped answering (``reply_watch.py``)
and dial it anew.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from subscriber_ext.transport.client.chunk_replies import discard_rest, parse_chunk
from subscriber_ext.transport.client.client_report import ClientReport
from subscriber_ext.transport.client.reply_watch import SILENT_TIMEOUTS, ReplyWatch
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import TransportError
from weightpub_wire.monitored_dealer import MonitoredDealer, chunk_reply_bytes
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
        self._dealer, self.sub = _open(ctx, endpoint, request_timeout, limits, hooks)
        self.dealer, self.monitor = self._dealer.sock, self._dealer.monitor
        #: a header (``chunk_frame.FOLLOWS``) whose payload is the DEALER's next message
        self.pairing = chunk_frame.PayloadPairing()
        #: handshakes that succeeded: more than one means the DEALER was connected anew
        self.connections = 0

    def close(self) -> None:
        self._dealer.close()
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

    def read_reply(self, limits: wire.Limits, expect: tuple[type, ...]
                   ) -> tuple[chunk_frame.ChunkHeader, zmq.Frame] | wire.Message | None:
        """The next reply on the DEALER: (header, frame) of a chunk (inline, or the payload
        message after its ``FOLLOWS`` header), a control message of ``expect``, or None (a
        header whose payload is the next message); ``ProtocolError`` (the rest of it
        dropped) otherwise."""
        first = self.dealer.recv(copy=False)
        more = int(self.dealer.getsockopt(zmq.RCVMORE))
        self.replies.heard(time.monotonic())
        try:
            if self.pairing.due is not None:  # the payload of the header before it
                return self.pairing.take(first.buffer, more), first
            if chunk_frame.is_chunk(first.buffer):
                header = parse_chunk(first, more)
                if header.follows:
                    self.pairing.expect(header)
                    return None
                return header, first
            message = wire.decode(first.buffer, limits=limits, expect=expect)
        finally:
            discard_rest(self.dealer, more)
        return message

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

    def on_handshake_events(self) -> bool:
        """Handshake events of the DEALER: a refusal becomes ``last_error`` at once.

        True when the DEALER is connected anew (ZeroMQ dialled again on its own after
        the connection ended): the ROUTER knows the new connection under a new identity,
        so nothing asked on the old one will be answered, and a payload the old one owed
        never comes (the pairing starts afresh)."""
        report = self._report
        reconnected = False
        for why in self._dealer.handshakes():
            if why is None:
                self.connections += 1
                if self.connections > 1:
                    reconnected = True
                    self.pairing = chunk_frame.PayloadPairing()
                if isinstance(report.error, TransportError):
                    report.resolved(report.error)  # the refusal is over (the key was allowed)
            else:
                self.handshake_failures += 1
                report.problem(TransportError(why))
                report.warn.warning("handshake", why)
        return reconnected

    def link_handshake(self, error: TransportError, refused: bool) -> None:
        """Another DEALER of this client (a trainer rank's) was refused its handshake
        (``refused``), or took it after all: reported as this DEALER's would be."""
        if refused:
            self.handshake_failures += 1
            self._report.problem(error)
            self._report.warn.warning("handshake", str(error))
        else:
            self._report.resolved(error)

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
        self._dealer.redial()
        self.pairing = chunk_frame.PayloadPairing()  # a payload due before the redial is lost

    def redial_sub(self) -> None:
        """Dial the PUB endpoint anew (after the publisher went silent on it)."""
        if self.pub_endpoint:
            _redial(self.sub, self.pub_endpoint)


def _open(ctx: zmq.Context, endpoint: str, request_timeout: float, limits: wire.Limits,
          hooks: list[Callable[..., None]]) -> tuple[MonitoredDealer, zmq.Socket]:
    """(the DEALER connected to ``endpoint`` with its monitor, the SUB not yet connected)."""
    sub = ctx.socket(zmq.SUB)
    configure_socket(sub, heartbeat_interval=1.0)
    for hook in hooks:
        hook(sub, server=False)
    sub.setsockopt(zmq.MAXMSGSIZE, limits.max_control_bytes)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:  # options, CURVE, monitor: one factory for every chunk client (monitored_dealer.py)
        dealer = MonitoredDealer(ctx, endpoint, hooks=hooks, handshake_timeout=request_timeout,
                                 max_message_bytes=chunk_reply_bytes(limits.max_control_bytes))
    except BaseException:
        sub.close(linger=0)
        raise
    return dealer, sub


def _redial(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError:
        pass  # ZeroMQ had already dropped it: connecting again is all there is to do
    connect(sock, endpoint)
