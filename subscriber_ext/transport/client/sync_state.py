"""What the parts of the subscriber's state machine share: the ``SyncClient`` as they see it.

``sync_client.py`` keeps the target's life and the frame dispatch; its parts
(``instance_following``, ``version_choice``, ``fetch_credit``, ``chunk_replies``,
``client_sockets``) are functions over this view, so they never import
``sync_client`` (no import cycle) and mypy checks that ``SyncClient`` provides
every field and method they use. Underscored members are the client's own
bookkeeping, shared only with these parts.
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

from subscriber_ext.transport.client.reply_watch import ReplyWatch
from subscriber_ext.transport.peers.peering import Peering
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.chunk_listener import ChunkListener
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly, DeltaState
from subscriber_ext.transport.staging.request_table import RequestTable, VersionBackoff
from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["SyncState"]


class SyncState(Protocol):
    """The subscriber's protocol state, as ``SyncClient`` holds it."""

    endpoint: str
    options: Any  # a ``SyncOptions`` (defined in sync_client, next to the client)
    state: str
    instance: str | None
    target: Assembly | None
    queued: wire.Manifest | None
    current_version: int
    applied_version: int
    latest_seen: int
    error: WeightPubError | None
    received_bytes: int
    checksum_failures: int
    ignored_manifests: int
    handshake_failures: int
    warn: RateLimitedLog
    gate: BudgetGate
    deltas: DeltaState
    requests: RequestTable
    backoff: VersionBackoff
    replies: ReplyWatch
    listeners: list[ChunkListener]
    peering: Peering | None
    collective: Any  # a ``CollectiveMember`` when the option is on
    dealer: zmq.Socket
    sub: zmq.Socket
    monitor: zmq.Socket
    _latest_req: int
    _latest_sent: float
    _last_heard: float
    _ttl: float
    _pub_endpoint: str
    _report_dirty: bool

    def send(self, message: Any) -> bool: ...

    def consider(self, manifest: wire.Manifest, *, confirmed: bool = False) -> None: ...

    def _start(self, manifest: wire.Manifest) -> None: ...

    def _complete(self, target: Assembly) -> None: ...

    def _drop_target(self) -> None: ...

    def _bad(self, why: WeightPubError) -> None: ...

    def _count_retry(self, chunk: int, why: str, error: type[WeightPubError]) -> bool: ...

    def _delta_failed(self, target: DeltaAssembly, why: WeightPubError) -> None: ...
