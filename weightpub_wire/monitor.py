"""Socket monitors: connection and handshake events, in words.

ZeroMQ reports a refused CURVE handshake only on a socket monitor; without one
a refused client just sees silence until its timeout. Both sides open a monitor
(an inproc PAIR socket) next to their sockets and poll it in their loop:

- the subscriber turns a refusal into a ``TransportError`` naming the cause
  (``describe_handshake_failure``) within the handshake timeout;
- the publisher logs refusals at WARNING and learns each accepted connection's
  file descriptor (``publisher/serving/connections.py`` bounds what a connection may hold).

Close a monitor with ``close_monitor``, never by closing its PAIR alone: libzmq 4.3.5
sends each event to the PAIR with a *blocking* send from the context's I/O thread, so
an event of a socket still open (a ``CONNECT_RETRIED`` every reconnect interval while
its peer is gone, a ``DISCONNECTED``) with the PAIR closed blocks that I/O thread for
good: every socket of the context goes deaf (no handshake, no heartbeat, no reply).
Seen when a sharded trainer restarted: the links to the gone ranks were closed monitor
first while retrying, and the replica never heard the new instance.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

import zmq

__all__ = ["MonitorEvent", "close_monitor", "describe_handshake_failure", "open_monitor",
           "read_events"]

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass(frozen=True, slots=True)
class MonitorEvent:
    event: int
    value: int  # an fd (accepted/connected/disconnected), an error or ZAP status code
    endpoint: str


def open_monitor(sock: zmq.Socket, events: int = zmq.EVENT_ALL) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s events (close it before ``sock``)."""
    address = f"inproc://weightpub-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events)
    pair = sock.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return pair


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop ``sock``'s events, then close ``monitor`` (its PAIR); ``sock`` stays open.

    ``disable_monitor`` takes libzmq's monitor lock, so no event is being sent once it
    returns and none is sent after; only then may the PAIR go (see the module's note)."""
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is being closed: it sends no more events
    monitor.close(linger=0)


def read_events(monitor: zmq.Socket, limit: int = 1000) -> list[MonitorEvent]:
    """The events waiting on ``monitor`` (at most ``limit``), without blocking."""
    out: list[MonitorEvent] = []
    while len(out) < limit:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        if len(frames) != 2 or len(frames[0]) != 6:
            continue
        event, value = struct.unpack("=Hi", frames[0])
        out.append(MonitorEvent(event, value, frames[1].decode(errors="replace")))
    return out


_MECHANISM = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTO = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC


def describe_handshake_failure(event: MonitorEvent, *, client: bool) -> str | None:
    """Why a handshake failed, in words, or None if ``event`` is not a handshake failure."""
    if event.event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if client:
            return (f"the publisher at {event.endpoint} refused this client's CURVE key "
                    f"(ZAP status {event.value}): add its public key to the publisher's "
                    "curve_allowed_clients_dir")
        return f"refused a client on {event.endpoint}: CURVE key not allowed (ZAP {event.value})"
    if event.event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if event.value == _MECHANISM:
            return (f"security mismatch with {event.endpoint}: one side uses CURVE and the "
                    "other does not (check curve_server_key_file / curve_secret_key_file)")
        if event.value == _CRYPTO:
            return (f"CURVE handshake with {event.endpoint} failed to decrypt: the peer uses "
                    "a different key pair than this side expects")
        return f"ZMTP handshake with {event.endpoint} failed (protocol error {event.value:#x})"
    if event.event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if client:
            return (f"the connection to {event.endpoint} closed during the handshake: wrong "
                    "curve_server_key_file (not the publisher's public key), or the publisher "
                    "refused this client")
        return f"a handshake on {event.endpoint} failed (error {event.value})"
    return None
