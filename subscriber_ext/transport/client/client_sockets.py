"""A ``SyncClient``'s two sockets to its publisher, and what their handshakes say.

Split from ``sync_client.py``: socket hygiene is a list of options each with a
reason (frame-size caps before anything is read, no queueing to a peer that is
not connected, a handshake given up after ``request_timeout``), and a refused
CURVE handshake must become ``last_error`` at once rather than a silent stall.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from subscriber_ext.transport.client.reply_watch import SILENT_TIMEOUTS
from subscriber_ext.transport.client.sync_state import SyncState
from weightpub_wire import protocol as wire
from weightpub_wire.errors import TransportError
from weightpub_wire.monitor import describe_handshake_failure, open_monitor, read_events
from weightpub_wire.sockets import configure_socket, connect

__all__ = ["on_handshake_events", "open_client_sockets", "redial_sub", "watch_replies"]


def open_client_sockets(ctx: zmq.Context, endpoint: str, request_timeout: float,
                        limits: wire.Limits, hooks: list[Callable[..., None]],
                        ) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
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


def on_handshake_events(client: SyncState) -> None:
    """Handshake events of the DEALER: a refusal becomes ``last_error`` at once."""
    for event in read_events(client.monitor):
        if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if isinstance(client.error, TransportError):
                client.error = None  # the refusal is over (e.g. the key was allowed)
                client._report_dirty = True
            continue
        why = describe_handshake_failure(event, client=True)
        if why is not None:
            client.handshake_failures += 1
            client.error = TransportError(why)
            client._report_dirty = True
            client.warn.warning("handshake", why)


def watch_replies(client: SyncState, now: float) -> None:
    """Dial the ROUTER anew when the client has waited ``SILENT_TIMEOUTS`` request
    timeouts for a reply that cannot come (``reply_watch.py``). What was in flight
    times out and is asked again on the new connection."""
    waiting = client.requests.in_flight() > 0 or client.state != "ACTIVE" \
        or client.replies.refused
    if not waiting:
        client.replies.idle()
        return
    timeout = client.options.request_timeout
    if not client.replies.stalled(now, timeout):
        return
    client.warn.warning("redial", f"no reply from {client.endpoint} for "
                        f"{SILENT_TIMEOUTS * timeout:.0f}s while waiting for one; dialling again")
    _redial(client.dealer, client.endpoint)


def redial_sub(client: SyncState) -> None:
    """Dial the PUB endpoint anew (after the publisher went silent on it)."""
    if client._pub_endpoint:
        _redial(client.sub, client._pub_endpoint)


def _redial(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError:
        pass  # ZeroMQ had already dropped it: connecting again is all there is to do
    connect(sock, endpoint)
