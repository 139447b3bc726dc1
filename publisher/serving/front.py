"""``ServingFront``: what every serving process puts between its versions and the network.

A ``WeightPublisher`` and a sharded trainer's ``ShardCoordinator`` both serve
subscribers the same way: one ROUTER endpoint (the PUB beside it), the "secure
by default" bind rule, CURVE with the trainer's key pair, a ZAP handler that
enforces ``curve_allowed_clients_dir`` and names every client's key, a ZeroMQ
context of their own, and the serving thread. This part builds them once, in
that order, and tears them down in reverse; the owners compose it and add only
what is theirs (the collective path; the coordinator's collect socket and its
own ZAP domain).

Two steps, because a publisher starts its collective path between them: the
constructor checks everything (endpoints, key files, the allow-list directory)
and holds no resources, so a bad option fails before anything binds; ``start``
opens the context, the ZAP handler and the serving thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import zmq
from zmq.auth.thread import ThreadAuthenticator

from publisher.collective.collective_sender import CollectivePublisher
from publisher.deltas.delta_encoder import DeltaPublisher
from publisher.serving.server import ServerLimits, ServerOptions, ServingThread, StatusExtras
from publisher.store.version_store import VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.allow_list import AllowList, KeySet, start_authenticator
from weightpub_wire.endpoints import Endpoint, parse_endpoint, pub_bind_address
from weightpub_wire.security import check_bind_allowed, curve_server_hook

__all__ = ["ServingFront"]

log = logging.getLogger("weightpub.publisher")


class ServingFront:
    """Endpoint checks, CURVE and ZAP, the context and the serving thread of one server."""

    def __init__(self, endpoint: str, *, curve_secret_key_file: str | None = None,
                 curve_allowed_clients_dir: str | None = None, insecure: bool = False,
                 also_binds: Sequence[str] = (),
                 socket_hooks: Sequence[Callable[..., None]] = ()) -> None:
        """Check ``endpoint`` (and ``also_binds``, the owner's other sockets) against the
        bind rule and load the key file and allow-list; nothing is opened yet."""
        self.router: Endpoint = parse_endpoint(endpoint)
        self.curve_secret_key_file = curve_secret_key_file
        self.curve = curve_secret_key_file is not None
        others = [parse_endpoint(bound) for bound in also_binds]
        for where in (self.router, *others):
            check_bind_allowed(where, curve=self.curve, insecure=insecure,
                               allowed_clients_dir=curve_allowed_clients_dir)
        self.hooks: list[Callable[..., None]] = list(socket_hooks)
        if curve_secret_key_file is not None:
            self.hooks.append(curve_server_hook(curve_secret_key_file))  # validates the file
        self.allow_list = None if curve_allowed_clients_dir is None else \
            AllowList(curve_allowed_clients_dir)
        self.ctx: zmq.Context | None = None
        self._own_context = False
        self._authenticator: ThreadAuthenticator | None = None
        self._server: ServingThread | None = None
        self._closed = False

    def start(self, store: VersionStore, *, publisher_id: str, started_at: float,
              heartbeat_interval: float, limits: ServerLimits | None = None,
              context: zmq.Context | None = None,
              zap_domains: Mapping[str, KeySet] | None = None,
              deltas: DeltaPublisher | None = None,
              collective: CollectivePublisher | None = None,
              status_extras: Callable[[], StatusExtras] | None = None,
              budget_room: Callable[[], int] | None = None) -> ServingThread:
        """Open the context (``context``: the caller's; its only ZAP handler is ours), the ZAP
        handler (under CURVE: the allow-list, or any key, so every request names its key;
        ``zap_domains``: sockets of those domains admit only those keys) and the serving
        thread; on any failure what was opened is closed again before the error is raised."""
        self._own_context = context is None
        self.ctx = context or zmq.Context()
        try:
            if self.curve:
                self._authenticator = start_authenticator(self.ctx, self.allow_list, zap_domains)
            self._server = ServingThread(
                self.ctx, store,
                ServerOptions(router_bind=str(self.router),
                              pub_bind=pub_bind_address(self.router),
                              heartbeat_interval=heartbeat_interval,
                              limits=limits or ServerLimits(), curve=self.curve,
                              allow_list=self.allow_list),
                publisher_id=publisher_id, started_at=started_at, configure=self.hooks,
                deltas=deltas, collective=collective, status_extras=status_extras,
                budget_room=budget_room)
            self._server.start_and_wait()
        except BaseException:
            self._server = None
            self._release()
            raise
        return self._server

    @property
    def server(self) -> ServingThread:
        if self._server is None:
            raise RuntimeError("the serving front was not started")
        return self._server

    @property
    def endpoint(self) -> str:
        """The bound ROUTER address (the real port when bound to port 0)."""
        return self.server.router_endpoint

    def announce(self) -> None:
        """Publish the store's newest manifest on PUB now (from any thread)."""
        self.server.send_command(b"announce")

    def fleet(self) -> list[wire.Report]:
        return self.server.fleet()

    def close(self) -> None:
        """Stop the serving thread (bounded), then the ZAP handler (after the sockets: none is
        left unchecked), then our own context; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.send_command(b"close")
            self._server.join(timeout=10)
        self._release()

    def _release(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_context and self.ctx is not None:
            self.ctx.term()
            self._own_context = False
