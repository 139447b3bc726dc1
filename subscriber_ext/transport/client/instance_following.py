"""Which publisher instance a ``SyncClient`` follows, and how it stays in touch with it.

Split from ``sync_client.py``: the Clone pattern's snapshot (``latest``
request and reply), liveness (heartbeats, the silence TTL) and instance
changes belong together. The ROUTER this client dialled decides which instance
is current, never clocks: a manifest or heartbeat from another instance only
makes the client ask that ROUTER again, and it switches when the ``latest``
reply names the new instance (a restarted publisher).
"""

from __future__ import annotations

import logging
import time

from subscriber_ext.transport.client.sync_state import SyncState
from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import resolve_pub_endpoint
from weightpub_wire.errors import ProtocolError

__all__ = ["follow", "on_heartbeat", "on_latest", "request_latest", "unknown_instance"]

log = logging.getLogger("weightpub.subscriber")


def request_latest(client: SyncState, now: float) -> None:
    """Ask the ROUTER for its newest version and PUB address (INITIAL -> SYNCING)."""
    client._latest_req = client.requests.next_id()
    if client.send(wire.LatestRequest(req=client._latest_req)):
        client._latest_sent = now
        if client.state == "INITIAL":
            client.state = "SYNCING"


def follow(client: SyncState, publisher_id: str) -> None:
    """Switch to the instance the ROUTER named (first contact, or a restart)."""
    if client.instance is not None:
        log.warning("publisher restarted (new instance %s); following it", publisher_id[:16])
        client._drop_target()
        client.queued = None
    client.instance = publisher_id
    client.current_version = 0
    client.latest_seen = 0
    if client.collective is not None:
        client.collective.follow(publisher_id)
    client.gate.take_waiting()  # a version of the old instance no longer waits
    client.applied_version = 0  # an applied version of the old instance means nothing here
    client._report_dirty = True


def unknown_instance(client: SyncState, publisher_id: str, what: str) -> None:
    """Something from an instance the ROUTER has not confirmed: ignore it, ask the ROUTER."""
    client.ignored_manifests += what.startswith("manifest")
    client._report_dirty = True
    client.error = ProtocolError(
        f"ignored {what} of publisher instance {publisher_id[:32]} (following "
        f"{(client.instance or 'none')[:32]}); asking {client.endpoint} which one is current")
    client.warn.warning("instance", str(client.error))
    if time.monotonic() - client._latest_sent > 1.0:
        request_latest(client, time.monotonic())


def on_heartbeat(client: SyncState, beat: wire.Heartbeat) -> None:
    if beat.publisher_id != client.instance:
        unknown_instance(client, beat.publisher_id, "heartbeat")
        return
    client._last_heard = time.monotonic()
    client._ttl = max(3.0, 3 * beat.interval)
    client.latest_seen = max(client.latest_seen, beat.latest_version)
    behind = beat.latest_version > max(
        client.current_version, client.target.manifest.version if client.target else 0,
        client.gate.held_back(client.instance))
    if behind and time.monotonic() - client._latest_sent > 0.5:
        request_latest(client, time.monotonic())  # we missed a manifest: repair


def on_latest(client: SyncState, reply: wire.LatestReply) -> None:
    if reply.req != client._latest_req:
        return  # an answer to an older question: the newest one decides
    try:
        pub = resolve_pub_endpoint(client.endpoint, reply.pub_endpoint)
    except ProtocolError as exc:
        client._bad(exc)
        return
    if pub != client._pub_endpoint:
        if client._pub_endpoint:
            client.sub.disconnect(client._pub_endpoint)
        client.sub.connect(pub)
        client._pub_endpoint = pub
    client._ttl = max(3.0, 3 * reply.heartbeat_interval)
    client._last_heard = time.monotonic()
    client.state = "ACTIVE"
    if reply.publisher_id != client.instance:
        follow(client, reply.publisher_id)
    if client.collective is not None:
        client.collective.announce(reply.collective)
    if reply.manifest is not None:
        if reply.manifest.publisher_id != reply.publisher_id:
            client._bad(ProtocolError("latest_rep.manifest.publisher_id: differs from the "
                                      "replying instance"))
            return
        client.consider(reply.manifest, confirmed=True)
