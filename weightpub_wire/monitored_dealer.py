"""One DEALER dialled to one endpoint, with the monitor that reports its handshakes.

Why one factory: the subscriber dials three kinds of chunk server (the
publisher's ROUTER, each rank of a sharded trainer, each peer) and every one of
those DEALERs needs the same care: frame-size caps before anything is read, the
caller's socket hooks (CURVE), a handshake given up after the request timeout,
and a monitor, because ZeroMQ reports a refused CURVE handshake only there
(without one a refused client sees silence until its timeout). Written once
here, a new kind of source cannot forget one of them.

No ``IMMEDIATE``: with it, libzmq 4.3.5 ends a dropped connection's pipe at once,
with the rest of a chunk reply whose header frame was already read, and then
aborts the process on the next frame (zmq_recv; seen in the kill matrix, about 1
run in 4). Requests sent while disconnected wait in the pipe (bounded by SNDHWM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import zmq

from weightpub_wire import chunk_frame
from weightpub_wire.message_base import MAX_CHUNK_SIZE
from weightpub_wire.monitor import (
    MonitorEvent,
    close_monitor,
    describe_handshake_failure,
    open_monitor,
    read_events,
)
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["HANDSHAKE_EVENTS", "LINK_EVENTS", "MonitoredDealer", "chunk_reply_bytes"]

#: what a chunk client's monitor listens to: the handshake's outcome
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
#: and, for a link that must notice a peer going away, its disconnects and refused dials
LINK_EVENTS = HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

SocketHook = Callable[..., None]  # ``hook(sock, server=False)``: CURVE keys, and the like


def chunk_reply_bytes(max_control_bytes: int) -> int:
    """The largest frame a chunk server's reply may be: a whole chunk frame or a
    control message, whichever is larger."""
    return max(chunk_frame.frame_bytes(MAX_CHUNK_SIZE), max_control_bytes)


class MonitoredDealer:
    """A DEALER connected to ``endpoint`` and its monitor; close it with ``close``.

    ``handshake_timeout``: seconds after which a refused or silent handshake is
    given up (and reported), at least one; ``max_message_bytes``: no larger frame is
    accepted off the wire; ``unbounded_receive``: ``RCVHWM`` 0, so a reply already
    on its way is never dropped by ZeroMQ (the client bounds what it asks instead);
    ``events``: what the monitor reports (``HANDSHAKE_EVENTS`` or ``LINK_EVENTS``).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, *, hooks: Sequence[SocketHook],
                 handshake_timeout: float, max_message_bytes: int,
                 unbounded_receive: bool = True, events: int = HANDSHAKE_EVENTS) -> None:
        self.endpoint = endpoint
        #: a handshake succeeded and no disconnect since (``handshakes`` keeps it; it sees
        #: disconnects with ``events=LINK_EVENTS``)
        self.connected = False
        self.sock = ctx.socket(zmq.DEALER)
        try:
            configure_socket(self.sock, heartbeat_interval=1.0)
            for hook in hooks:
                hook(self.sock, server=False)
            if unbounded_receive:
                self.sock.setsockopt(zmq.RCVHWM, 0)
            self.sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, int(handshake_timeout * 1000)))
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            self.monitor = open_monitor(self.sock, events)
        except BaseException:
            self.sock.close(linger=0)
            raise
        try:
            connect(self.sock, endpoint)
        except BaseException:
            self.close()
            raise

    def events(self) -> list[MonitorEvent]:
        """The monitor's events waiting now (never blocks)."""
        return read_events(self.monitor)

    def handshakes(self) -> list[str | None]:
        """The handshakes finished since the last call, in order: None for one that
        succeeded, else why it was refused, in words (``describe_handshake_failure``)."""
        out: list[str | None] = []
        for event in read_events(self.monitor):
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                out.append(None)
                continue
            if event.event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                continue
            why = describe_handshake_failure(event, client=True)
            if why is not None:
                out.append(why)
        return out

    def redial(self) -> None:
        """Disconnect and connect again (ZeroMQ does not redial a connection that ended
        in a protocol error); the socket, its options and its monitor stay."""
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # ZeroMQ had already dropped it: connecting again is all there is to do
        connect(self.sock, self.endpoint)

    def close(self) -> None:
        """The monitor first (its events stopped, then its PAIR: ``close_monitor``), then
        the socket; idempotent."""
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            close_monitor(self.sock, monitor)
        self.sock.close(linger=0)
