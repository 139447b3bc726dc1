"""Which announced version a ``SyncClient`` fetches next, and which it leaves alone.

Split from ``sync_client.py``: the policy over one manifest is a list of
reasons not to start it (another publisher instance, already staged or waiting
for budget, never fits the budget, failed recently, this node's collective group
will receive it) and then conflation: a newer manifest replaces a target less
than ``switch_below_fraction`` received, otherwise it waits as the one queued.
Another data path (a collective round) may hand over a whole version instead.
A version given up is retried only after a growing back-off (1 s .. 30 s).
"""

from __future__ import annotations

import logging

from subscriber_ext.transport.client import instance_following
from subscriber_ext.transport.client.sync_state import SyncState
from subscriber_ext.transport.staging.assembly import Assembly
from weightpub_wire import protocol as wire

__all__ = ["consider", "deliver", "yield_target"]

log = logging.getLogger("weightpub.subscriber")


def consider(client: SyncState, manifest: wire.Manifest, *, confirmed: bool = False) -> None:
    """Decide whether a manifest becomes the target (conflation, publisher restarts).

    ``confirmed``: it came in a ``latest`` reply from the ROUTER this client dialled,
    which is the only thing that may make it follow another publisher instance.
    """
    if manifest.publisher_id != client.instance:
        if not confirmed:
            instance_following.unknown_instance(client, manifest.publisher_id,
                                                f"manifest v{manifest.version}")
            return
        instance_following.follow(client, manifest.publisher_id)
    client.latest_seen = max(client.latest_seen, manifest.version)
    if manifest.version <= max(client.current_version,
                               client.gate.waiting.version if client.gate.waiting else 0):
        return
    if client.gate.is_refused(manifest):
        return  # does not fit the budget; it never will
    if client.backoff.waiting(manifest.publisher_id, manifest.version):
        return  # failed recently; a newer version or the back-off expiring retries it
    if client.collective is not None and client.collective.defer(client, manifest):
        return  # this node's group will receive it (fetched here only if that fails)
    target = client.target
    if target is not None:
        if manifest.version <= target.manifest.version:
            return
        if target.done_fraction >= client.options.switch_below_fraction:
            if client.queued is None or manifest.version > client.queued.version:
                client.queued = manifest
            return
        log.info("conflating: version %d replaces %d (%.0f%% received)", manifest.version,
                 target.manifest.version, 100 * target.done_fraction)
        client._drop_target()
    client._start(manifest)


def deliver(client: SyncState, assembly: Assembly) -> None:
    """A version assembled and verified by another data path (a collective round):
    stage it exactly like a fetched one. An older fetch in progress gives way."""
    if assembly.manifest.version <= client.current_version:
        assembly.abandon()
        return
    if client.target is not None and client.target.manifest.version <= assembly.manifest.version:
        client._drop_target()
    client._complete(assembly)


def yield_target(client: SyncState, version: int) -> bool:
    """Give up an ongoing fetch older than ``version`` (a broadcast brings a newer one);
    False when the fetch in progress is of ``version`` or newer."""
    if client.target is None:
        return True
    if client.target.manifest.version >= version:
        return False
    client._drop_target()
    return True
