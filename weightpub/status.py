"""Ask a publisher for its status (versions held, subscribers' reports) with a timeout.

Everything in the reply came from peers; ``weightpub.fleet_view`` prints it
with every non-printable character replaced, and ``--json`` is ASCII-only.
"""

from __future__ import annotations

import zmq

from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError, WeightPubTimeout
from weightpub_wire.security import curve_client_hook

__all__ = ["fetch_status"]


def fetch_status(endpoint: str, *, timeout: float = 5.0, curve_server_key_file: str | None = None,
                 curve_secret_key_file: str | None = None) -> wire.StatusReply:
    """One request/reply on a throwaway DEALER socket."""
    parse_endpoint(endpoint)
    if curve_secret_key_file is not None and curve_server_key_file is None:
        raise ConfigError("--curve-secret-key-file needs --curve-server-key-file")
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.DEFAULT_LIMITS.max_control_bytes)
    if curve_server_key_file is not None:
        curve_client_hook(curve_server_key_file, curve_secret_key_file)(sock, server=False)
    try:
        sock.connect(endpoint)
        sock.send(wire.encode(wire.StatusRequest(req=1)))
        if not sock.poll(int(timeout * 1000)):
            raise WeightPubTimeout(f"no status reply from {endpoint} within {timeout}s")
        return wire.decode_as(sock.recv(), wire.StatusReply, limits=wire.DEFAULT_LIMITS)
    finally:
        sock.close()

