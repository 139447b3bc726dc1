"""CurveZMQ encryption, secret-key hygiene and the "secure by default" bind rule.

Keys are ZeroMQ certificate files as written by ``zmq.auth.create_certificates``
or ``weightpub keys create``. The publisher needs its secret key file;
subscribers need the publisher's public key file (and may bring their own key
pair, which the publisher can allow-list by directory, ``allow_list.py``).

Rules that fail closed, each with an error that says how to fix it:

- a secret key file that other users can read is refused (``chmod 600 <file>``);
- binding a non-loopback TCP address without CURVE is refused unless the caller
  says ``insecure=True`` (YAML ``insecure: true``); loopback, ipc and inproc stay easy;
- an allow-list directory without a server secret key is refused (it would be ignored);
- a client key pair without the server's public key is refused (it would be dropped).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from weightpub_wire.endpoints import Endpoint
from weightpub_wire.errors import ConfigError

__all__ = [
    "CurveIdentity",
    "SocketHook",
    "check_bind_allowed",
    "check_secret_key_file",
    "curve_client_hook",
    "curve_identity",
    "curve_server_hook",
    "is_local",
    "load_key_file",
]

log = logging.getLogger("weightpub.security")

SocketHook = Callable[..., None]
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "lo"}


def check_secret_key_file(path: str | Path) -> None:
    """Refuse a secret key file that group or others may read or write (POSIX only)."""
    if os.name != "posix":
        return
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as exc:
        raise ConfigError(f"curve key file {path}: cannot read ({exc.strerror})") from exc
    if mode & 0o077:
        raise ConfigError(
            f"curve key file {path}: permissions {mode:04o} let other users read the secret "
            f"key; run `chmod 600 {path}` (or create keys with `weightpub keys create`)")


def load_key_file(path: str | Path, *, need_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys of a certificate file; ``ConfigError`` names the file."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"curve key file {path}: cannot load ({exc})") from exc
    if need_secret and not secret:
        raise ConfigError(f"curve key file {path}: has no secret key (give the "
                          "'.key_secret' file, not the public '.key')")
    if secret:
        check_secret_key_file(path)
    return public, secret


def curve_server_hook(secret_key_file: str | Path) -> SocketHook:
    """Make the publisher's ROUTER and PUB CURVE servers."""
    public, secret = load_key_file(secret_key_file, need_secret=True)

    def hook(sock: zmq.Socket, *, server: bool) -> None:
        if server:
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True

    return hook


@dataclass(frozen=True, slots=True)
class CurveIdentity:
    """A subscriber's CURVE keys: the publisher's public key and its own key pair.

    Peer sharing reuses the same pair: the subscriber's peer ROUTER is a CURVE
    server with it, so the key the publisher authenticated on this subscriber's
    connection (and hands to other subscribers in their plans) is the key its
    peers check when they connect.
    """

    server_public: bytes
    public: bytes
    secret: bytes

    def client_hook(self) -> SocketHook:
        """Make a subscriber's DEALER and SUB CURVE clients of the publisher."""
        return self.peer_client_hook(self.server_public)

    def peer_client_hook(self, server_public: bytes) -> SocketHook:
        """A CURVE client of ``server_public`` (the publisher, or a peer) with this key pair."""

        def hook(sock: zmq.Socket, *, server: bool) -> None:
            if not server:
                sock.curve_serverkey = server_public
                sock.curve_publickey = self.public
                sock.curve_secretkey = self.secret

        return hook

    def peer_server_hook(self) -> SocketHook:
        """Make a subscriber's peer ROUTER a CURVE server with this key pair."""

        def hook(sock: zmq.Socket, *, server: bool) -> None:
            if server:
                sock.curve_secretkey = self.secret
                sock.curve_publickey = self.public
                sock.curve_server = True

        return hook


def curve_identity(server_public_key_file: str | Path,
                   client_secret_key_file: str | Path | None = None) -> CurveIdentity:
    """Load the publisher's public key and this client's key pair (ephemeral when no file)."""
    server_public, _ = load_key_file(server_public_key_file, need_secret=False)
    if client_secret_key_file is None:
        public, secret = zmq.curve_keypair()  # ephemeral: encryption without client identity
    else:
        public, secret_or_none = load_key_file(client_secret_key_file, need_secret=True)
        secret = secret_or_none or b""
    return CurveIdentity(server_public, public, secret)


def curve_client_hook(server_public_key_file: str | Path,
                      client_secret_key_file: str | Path | None = None) -> SocketHook:
    """Make a subscriber's DEALER and SUB CURVE clients of the publisher."""
    return curve_identity(server_public_key_file, client_secret_key_file).client_hook()


def is_local(endpoint: Endpoint) -> bool:
    """ipc/inproc, or TCP on a loopback address: nobody else on the network can reach it."""
    if endpoint.scheme != "tcp":
        return True
    host = endpoint.host.lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: reachable from the network


def check_bind_allowed(endpoint: Endpoint, *, curve: bool, insecure: bool,
                       allowed_clients_dir: str | Path | None = None) -> None:
    """The "secure by default" rule for a publisher (or relay) binding ``endpoint``."""
    if allowed_clients_dir is not None and not curve:
        raise ConfigError(
            f"curve_allowed_clients_dir {allowed_clients_dir}: needs curve_secret_key_file "
            "(without the server's secret key no client is authenticated and the allow-list "
            "would be ignored)")
    if curve or is_local(endpoint):
        return
    if not insecure:
        raise ConfigError(
            f"endpoint {endpoint}: binding a non-loopback address without CURVE would serve "
            "the weights in plaintext to anyone who can reach it; give "
            "curve_secret_key_file (keys: `weightpub keys create`), bind 127.0.0.1, or say "
            "insecure=True (YAML: `insecure: true`) if the network is trusted")
    log.warning("publisher on %s without CURVE (insecure=True): anyone who can reach it can "
                "read the weights and send reports", endpoint)
