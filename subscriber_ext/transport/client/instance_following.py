"""Which publisher instance a ``SyncClient`` follows, and how it stays in touch with it.

Split from ``sync_client.py``: the Clone pattern's snapshot (``latest``
request and reply), liveness (heartbeats, the silence TTL) and instance
changes belong together. The ROUTER this client dialled decides which instance
is current, never clocks: a manifest or heartbeat from another instance only
makes the client ask that ROUTER again, and it switches when the ``latest``
reply names the new instance (a restarted publisher). What a switch means for
the rest of the client (the target, the staged version) is the client's
``on_switch`` callback.

States (ZeroMQ Guide "Clone" client)::

    INITIAL --latest request--> SYNCING --latest reply--> ACTIVE
       ^                                                     |
       +------------- publisher silent for ttl --------------+  (re-sync; DEALER reconnects)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from subscriber_ext.transport.client.client_report import ClientReport
from subscriber_ext.transport.client.client_sockets import ClientSockets
from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import resolve_pub_endpoint
from weightpub_wire.errors import ProtocolError

__all__ = ["InstanceFollower"]

log = logging.getLogger("weightpub.subscriber")


class InstanceFollower:
    """The followed instance, the client's sync state, and when the publisher was last heard."""

    def __init__(self, sockets: ClientSockets, report: ClientReport,
                 next_id: Callable[[], int], on_switch: Callable[[str, bool], None]) -> None:
        """``next_id``: a fresh request id; ``on_switch(publisher_id, restarted)``: the
        client now follows another instance (``restarted``: not the first one)."""
        self.state = "INITIAL"
        self.instance: str | None = None  # the publisher_id followed (confirmed by the ROUTER)
        self.latest_seen = 0  # newest version the current publisher instance announced
        self.ignored_manifests = 0
        self._sockets = sockets
        self._report = report
        self._next_id = next_id
        self._on_switch = on_switch
        self._latest_req = 0
        self._latest_sent = 0.0
        self._last_heard = 0.0
        self._ttl = 3.0

    def tick(self, now: float, request_timeout: float) -> None:
        """Re-sync after silence; ask for the newest version until in sync."""
        if self.state != "ACTIVE" or now - self._last_heard > self._ttl:
            if self.state == "ACTIVE":
                log.warning("publisher silent for %.1fs; re-syncing", now - self._last_heard)
                self.state = "SYNCING"
                self._sockets.redial_sub()  # a SUB connection ended by a protocol error
            if now - self._latest_sent >= min(1.0, request_timeout):
                self.request_latest(now)

    def request_latest(self, now: float) -> None:
        """Ask the ROUTER for its newest version and PUB address (INITIAL -> SYNCING)."""
        self._latest_req = self._next_id()
        if self._sockets.send(wire.LatestRequest(req=self._latest_req)):
            self._latest_sent = now
            if self.state == "INITIAL":
                self.state = "SYNCING"

    def resync(self) -> None:
        """Ask for the newest version again right away (a version was given up)."""
        self._latest_sent = 0.0
        self.state = "SYNCING"

    def heard(self, now: float) -> None:
        """A reply from the publisher: it is alive."""
        self._last_heard = now

    def saw(self, version: int) -> None:
        """The followed instance announced ``version``."""
        self.latest_seen = max(self.latest_seen, version)

    def follow(self, publisher_id: str) -> None:
        """Switch to the instance the ROUTER named (first contact, or a restart)."""
        restarted = self.instance is not None
        if restarted:
            log.warning("publisher restarted (new instance %s); following it", publisher_id[:16])
        self._on_switch(publisher_id, restarted)
        self.instance = publisher_id
        self.latest_seen = 0

    def unknown_instance(self, publisher_id: str, what: str) -> None:
        """Something from an instance the ROUTER has not confirmed: ignore it, ask the ROUTER."""
        self.ignored_manifests += what.startswith("manifest")
        error = ProtocolError(
            f"ignored {what} of publisher instance {publisher_id[:32]} (following "
            f"{(self.instance or 'none')[:32]}); asking {self._sockets.endpoint} which one "
            "is current")
        self._report.problem(error)
        self._report.warn.warning("instance", str(error))
        if time.monotonic() - self._latest_sent > 1.0:
            self.request_latest(time.monotonic())

    def on_heartbeat(self, beat: wire.Heartbeat, have: int) -> None:
        """``have``: the newest version this client holds, fetches or holds back."""
        if beat.publisher_id != self.instance:
            self.unknown_instance(beat.publisher_id, "heartbeat")
            return
        self._last_heard = time.monotonic()
        self._ttl = max(3.0, 3 * beat.interval)
        self.latest_seen = max(self.latest_seen, beat.latest_version)
        if beat.latest_version > have and time.monotonic() - self._latest_sent > 0.5:
            self.request_latest(time.monotonic())  # we missed a manifest: repair

    def on_latest(self, reply: wire.LatestReply) -> bool:
        """Take the answer to the newest ``latest`` request (subscribe at its PUB address,
        follow its instance); False: an older answer, or a bad one (reported)."""
        if reply.req != self._latest_req:
            return False  # an answer to an older question: the newest one decides
        try:
            pub = resolve_pub_endpoint(self._sockets.endpoint, reply.pub_endpoint)
        except ProtocolError as exc:
            self._report.bad(exc)
            return False
        self._sockets.follow_pub(pub)
        self._ttl = max(3.0, 3 * reply.heartbeat_interval)
        self._last_heard = time.monotonic()
        self.state = "ACTIVE"
        if reply.publisher_id != self.instance:
            self.follow(reply.publisher_id)
        return True
