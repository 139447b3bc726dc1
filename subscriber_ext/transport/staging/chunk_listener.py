"""Who hears about a version while it arrives: the peer server, a ``ProgressFeed``
(``on_progress``), and cut-through relays; ``SyncClient.listeners`` is the one list.

A ``ChunkListener``'s methods run on the subscriber's thread, in this order:
``target_started`` (fetching begins; ``SyncClient.target`` is already the new
assembly; again for the same version when a delta fell back to a full fetch),
``chunk_verified`` for each chunk whose final bytes matched the manifest's checksum
(never a chunk of an intermediate delta step: ``final_bytes`` is asked before
the chunk is verified, since verifying a step's last chunk moves to the next;
``data`` is valid only during the call: copy what you keep), then
``target_completed`` or ``target_dropped`` (conflated, given up, or the
publisher restarted). They must return quickly. Optional: ``target_refused(manifest)``,
a version whose target could not even be built (a slice plan of another layout: the
vLLM side's ``SliceReceiver`` records a plan for it and resubscribes).
"""

from __future__ import annotations

from typing import Protocol

from subscriber_ext.transport.staging.assembly import Assembly
from weightpub_wire.protocol import Manifest

__all__ = ["ChunkListener", "final_bytes"]


class ChunkListener(Protocol):
    def target_started(self, manifest: Manifest) -> None: ...

    def chunk_verified(self, manifest: Manifest, chunk: int, data: memoryview) -> None: ...

    def target_completed(self, manifest: Manifest) -> None: ...

    def target_dropped(self, manifest: Manifest) -> None: ...


def final_bytes(target: Assembly) -> bool:
    """Whether a chunk the target verifies now holds the version's own bytes (a delta
    rebuild's earlier steps hold intermediate versions)."""
    return not target.fetch_base or target.fetch_version == target.manifest.version
