"""What peer sharing is given: its options, and what it needs of its ``SyncClient``.

Why apart from ``peering.py``: these are checked when a ``WeightSubscriber`` is
built (``subscriber_options.py``), before any socket exists, and they are the
contract between peering and the client (``PeerClient``), which reads best
without the socket work of ``Peering`` around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import zmq
from pydantic import Field, field_validator, model_validator

from subscriber_ext.transport.peers.peer_server import PeerServerLimits
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.chunk_source import SourceSink
from subscriber_ext.transport.staging.delta_assembly import DeltaState
from subscriber_ext.transport.staging.request_table import RequestTable
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.config_file import check_endpoint
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError
from weightpub_wire.option_set import OptionSet, unit
from weightpub_wire.security import is_local

__all__ = ["PeerClient", "PeerOptions", "PeerSettings", "default_peer_bind"]


class PeerSettings(OptionSet):
    """Peer sharing as a user asks for it (``WeightSubscriber`` keywords, YAML, init_info)."""

    peer_share: bool = Field(
        False, description="serve verified chunks to other subscribers of the publisher and "
                           "fetch from them as its tracker plans")
    peer_bind: str | None = Field(
        None, description="where to serve peers (default: 127.0.0.1 for a loopback "
                          "publisher, else every interface; port 0)")
    insecure: bool = Field(
        False, description="serve peers on a non-loopback address without CURVE")
    upload_mbit: float | None = Field(
        None, gt=0, json_schema_extra=unit("Mbit/s"),
        description="upload to peers at most this fast (None: no rate bound)")
    upload_cpu_share: float = Field(
        0.25, gt=0, le=64, json_schema_extra=unit("cores"),
        description="CPU serving peers may take, in cores")

    @field_validator("peer_bind")
    @classmethod
    def _peer_bind(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @model_validator(mode="after")
    def _only_with_peer_share(self) -> Self:
        if not self.peer_share:
            given = sorted(name for name in _PEER_ONLY
                           if getattr(self, name) != type(self).model_fields[name].default)
            if given:
                raise ValueError(f"{', '.join(given)}: only with peer_share=True")
        return self

    def peer_options(self) -> PeerOptions | None:
        """What the sync client runs peering with (None: peer sharing is off)."""
        if not self.peer_share:
            return None
        return PeerOptions(bind=self.peer_bind, insecure=self.insecure,
                           upload_bytes_per_s=None if self.upload_mbit is None
                           else self.upload_mbit * 1e6 / 8,
                           upload_cpu_share=self.upload_cpu_share)


_PEER_ONLY = ("peer_bind", "insecure", "upload_mbit", "upload_cpu_share")


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """What ``peer_share=True`` runs with; the user's values are declared (and checked)
    by ``PeerSettings``, the rest are internal bounds."""

    bind: str | None = None  # None: 127.0.0.1 for a loopback publisher, else 0.0.0.0; port 0
    insecure: bool = False  # serve peers on a non-loopback address without CURVE
    upload_bytes_per_s: float | None = None  # None: no rate bound
    upload_cpu_share: float | None = 0.25  # of one core, for serving; None: no CPU bound
    window_chunks: int = 4  # chunks asked ahead of each peer (they wait there: cut-through)
    hello_interval: float = 1.0
    plan_wait: float = 0.5  # a version without a place in the held plan waits for one
    #: a sliced member's gathered slices kept for serving (``slice_cache.py``; 0: none)
    slice_cache_bytes: int = 64 << 20
    server: PeerServerLimits = field(default_factory=PeerServerLimits)

    def __post_init__(self) -> None:
        rate = self.upload_bytes_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
            raise ConfigError(f"upload_mbit: {rate!r} is not a number")
        PeerSettings(peer_share=True, peer_bind=self.bind, insecure=self.insecure,
                     upload_mbit=None if rate is None else rate * 8 / 1e6,
                     **({} if self.upload_cpu_share is None
                        else {"upload_cpu_share": self.upload_cpu_share}))
        if self.slice_cache_bytes < 0:
            raise ConfigError(f"slice_cache_bytes: {self.slice_cache_bytes} is negative "
                              "(bytes of gathered slices kept; 0: none)")
        if not 1 <= self.window_chunks <= wire.MAX_CHUNKS_IN_FLIGHT:
            raise ConfigError(f"peer window: {self.window_chunks} chunks is outside "
                              f"[1, {wire.MAX_CHUNKS_IN_FLIGHT}]")


class PeerClient(Protocol):
    """What peering uses of its ``SyncClient`` (the subscriber's protocol state)."""

    @property
    def dealer(self) -> zmq.Socket: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def instance(self) -> str | None: ...
    @property
    def target(self) -> Assembly | None: ...
    @property
    def current_version(self) -> int: ...
    @property
    def latest_seen(self) -> int: ...
    @property
    def queued(self) -> wire.Manifest | None: ...
    @property
    def gate(self) -> BudgetGate: ...
    @property
    def deltas(self) -> DeltaState: ...
    @property
    def requests(self) -> RequestTable: ...  # in flight; peers' are marked with their link
    @property
    def options(self) -> Any: ...
    @property
    def pool(self) -> BufferPool: ...  # staging buffers: sends without a copy counted there
    @property
    def sink(self) -> SourceSink: ...  # where a peer stream source's chunks land

    def send(self, message: Any) -> bool: ...

    def discard_rest(self, more: int, sock: zmq.Socket | None = None) -> None: ...

    def on_chunk(self, header: chunk_frame.ChunkHeader, frame: zmq.Frame,
                 source: Any = None, via: Any = None) -> None: ...


def default_peer_bind(publisher_endpoint: str) -> str:
    """Loopback when the publisher is on this host (tests, one machine), else every interface."""
    return "tcp://127.0.0.1:0" if is_local(parse_endpoint(publisher_endpoint)) \
        else "tcp://0.0.0.0:0"
