"""Socket setup both sides share: hygiene options, binds that fail with our error, and
cutting one TCP connection under ZeroMQ (a reader that stopped reading)."""

from __future__ import annotations

import os
import socket

import zmq

from weightpub_wire.errors import TransportError

__all__ = ["bind", "configure_socket", "connect", "cut_connection", "dup_socket", "peer_name"]


def configure_socket(sock: zmq.Socket, *, heartbeat_interval: float,
                     pings: bool = True) -> None:
    """No linger on close; ZMTP heartbeats drop dead peers after three silent intervals.

    ``pings=False`` for a socket that serves many peers (a ROUTER the publisher, the
    collect socket or a peer binds): it answers its peers' PINGs (whose TTL still
    drops a dead peer) but sends none and so times none out itself. Why: libzmq 4.3.5
    aborts the whole process (``Assertion failed: !_io_error
    (src/stream_engine_base.cpp:310)``) when a heartbeat timeout fires on a
    connection whose input is stopped because its receive queue is full, which any
    peer sending requests faster than they are served brings about (a flood test
    aborted 3 of 6 runs on a loaded box with a 0.2 s interval; 0 of 6 without).
    """
    sock.setsockopt(zmq.LINGER, 0)
    ivl = max(int(heartbeat_interval * 1000), 100)
    if not pings:
        sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
        return
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl * 3)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ivl * 3)


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind and return the real address (port 0 resolved); ``TransportError`` on failure."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {address}: {exc.strerror}") from exc
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


def connect(sock: zmq.Socket, address: str) -> None:
    """Connect (asynchronous in ZeroMQ); ``TransportError`` if the address is unusable."""
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot connect to {address}: {exc.strerror}") from exc


def dup_socket(fd: int) -> socket.socket | None:
    """A socket object of its own over a copy of descriptor ``fd`` (None: gone)."""
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


def peer_name(fd: int) -> str:
    """The remote address of ZeroMQ's connection ``fd`` (``""``: not a connected socket)."""
    sock = dup_socket(fd)
    if sock is None:
        return ""
    try:
        return str(sock.getpeername())
    except OSError:
        return ""
    finally:
        sock.close()


def cut_connection(fd: int, peer: str) -> bool:
    """Shut a peer's TCP connection down under ZeroMQ (it notices and frees the pipe,
    with every message queued to it).

    ``peer`` (``peer_name`` when the connection was first seen) guards against a
    descriptor number reused since.
    """
    sock = dup_socket(fd)
    if sock is None:
        return False
    try:
        if peer and str(sock.getpeername()) != peer:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()
