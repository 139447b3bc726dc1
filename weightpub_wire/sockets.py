"""Socket setup both sides share: hygiene options, and binds that fail with our error."""

from __future__ import annotations

import zmq

from weightpub_wire.errors import TransportError

__all__ = ["bind", "configure_socket", "connect"]


def configure_socket(sock: zmq.Socket, *, heartbeat_interval: float) -> None:
    """No linger on close; ZMTP heartbeats drop dead peers after three silent intervals."""
    sock.setsockopt(zmq.LINGER, 0)
    ivl = max(int(heartbeat_interval * 1000), 100)
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
