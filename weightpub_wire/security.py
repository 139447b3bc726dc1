"""CurveZMQ encryption and (optionally) client allow-listing, when configured.

Keys are ZeroMQ certificate files as written by ``zmq.auth.create_certificates``.
The publisher needs its secret key file; subscribers need the publisher's
public key file (and may bring their own key pair, which the publisher can
allow-list by directory). Without keys, sockets are plain TCP.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from weightpub_wire.errors import ConfigError

__all__ = ["SocketHook", "curve_client_hook", "curve_server_hook", "start_authenticator"]

SocketHook = Callable[..., None]


def _load(path: str | Path, *, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"curve key file {path}: cannot load ({exc})") from exc
    if need_secret and not secret:
        raise ConfigError(f"curve key file {path}: has no secret key")
    return public, secret


def curve_server_hook(secret_key_file: str | Path) -> SocketHook:
    """Make the publisher's ROUTER and PUB CURVE servers."""
    public, secret = _load(secret_key_file, need_secret=True)

    def hook(sock: zmq.Socket, *, server: bool) -> None:
        if server:
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True

    return hook


def curve_client_hook(server_public_key_file: str | Path,
                      client_secret_key_file: str | Path | None = None) -> SocketHook:
    """Make a subscriber's DEALER and SUB CURVE clients of the publisher."""
    server_public, _ = _load(server_public_key_file, need_secret=False)
    if client_secret_key_file is None:
        public, secret = zmq.curve_keypair()  # ephemeral: encryption without client identity
    else:
        public, secret_or_none = _load(client_secret_key_file, need_secret=True)
        secret = secret_or_none or b""

    def hook(sock: zmq.Socket, *, server: bool) -> None:
        if not server:
            sock.curve_serverkey = server_public
            sock.curve_publickey = public
            sock.curve_secretkey = secret

    return hook


def start_authenticator(ctx: zmq.Context, allowed_clients_dir: str | Path) -> ThreadAuthenticator:
    """Only clients whose public keys are in ``allowed_clients_dir`` may connect."""
    directory = Path(allowed_clients_dir)
    if not directory.is_dir():
        raise ConfigError(f"curve allowed_clients_dir {directory}: not a directory")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(directory))
    return auth
