"""One endpoint string is all a subscriber is given; the PUB address is derived.

The publisher binds its ROUTER on the configured endpoint and its PUB socket on
the same host (a fresh port for tcp, ``<path>.pub`` for ipc/inproc), and
announces the PUB address in every ``latest`` reply. A subscriber keeps the
host it dialled and takes only the announced port, so ``tcp://*:5555`` or
``0.0.0.0`` binds still work from another machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightpub_wire.errors import ConfigError, ProtocolError

__all__ = ["WILDCARD_HOSTS", "Endpoint", "is_wildcard", "parse_endpoint", "pub_bind_address",
           "resolve_pub_endpoint"]

_SCHEMES = ("tcp", "ipc", "inproc")
#: hosts that bind every interface: nobody can dial them
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str
    host: str  # tcp: host or address; ipc/inproc: the path/name
    port: int | None = None

    def __str__(self) -> str:
        if self.scheme == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp://{host}:{self.port}"
        return f"{self.scheme}://{self.host}"


def parse_endpoint(text: str, *, error: type[Exception] = ConfigError) -> Endpoint:
    """Parse ``tcp://host:port``, ``ipc:///path`` or ``inproc://name``."""
    if not isinstance(text, str) or "://" not in text:
        raise error(f"endpoint: {text!r} is not of the form scheme://address")
    scheme, rest = text.split("://", 1)
    if scheme not in _SCHEMES:
        raise error(f"endpoint: scheme {scheme!r} not supported (use {', '.join(_SCHEMES)})")
    if not rest:
        raise error(f"endpoint: {text!r} has no address")
    if scheme != "tcp":
        return Endpoint(scheme, rest)
    host, sep, port_text = rest.rpartition(":")
    if not sep or not port_text.isdigit():
        raise error(f"endpoint: {text!r} needs a numeric port (tcp://host:port)")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise error(f"endpoint: port {port} is outside 0..65535")
    return Endpoint("tcp", host.strip("[]") or "*", port)


def is_wildcard(endpoint: Endpoint) -> bool:
    """A tcp endpoint bound on every interface: others must be given another host to dial."""
    return endpoint.scheme == "tcp" and endpoint.host in WILDCARD_HOSTS


def pub_bind_address(router: Endpoint) -> str:
    """Where the PUB socket binds, next to the ROUTER."""
    if router.scheme == "tcp":
        host = f"[{router.host}]" if ":" in router.host else router.host
        return f"tcp://{host}:*"
    return f"{router.scheme}://{router.host}.pub"


def resolve_pub_endpoint(dialled: str, announced: str) -> str:
    """The PUB address a subscriber connects to: its own host, the announced port."""
    here = parse_endpoint(dialled)
    there = parse_endpoint(announced, error=ProtocolError)
    if here.scheme != there.scheme:
        raise ProtocolError(
            f"latest_rep.pub_endpoint: scheme {there.scheme!r} differs from {here.scheme!r}"
        )
    if here.scheme == "tcp":
        return str(Endpoint("tcp", here.host, there.port))
    return announced
