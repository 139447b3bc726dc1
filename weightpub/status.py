"""Ask a publisher for its status (versions held, subscribers' reports) with a timeout."""

from __future__ import annotations

import zmq

from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import WeightPubTimeout

__all__ = ["fetch_status"]


def fetch_status(endpoint: str, *, timeout: float = 5.0) -> wire.StatusReply:
    """One request/reply on a throwaway DEALER socket."""
    parse_endpoint(endpoint)
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(wire.encode(wire.StatusRequest(req=1)))
        if not sock.poll(int(timeout * 1000)):
            raise WeightPubTimeout(f"no status reply from {endpoint} within {timeout}s")
        return wire.decode_as(sock.recv(), wire.StatusReply)
    finally:
        sock.close()
