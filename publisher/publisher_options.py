"""``PublisherOptions``: everything a ``WeightPublisher`` is configured with, checked once.

Why one object: the trainer API takes flat keywords (``chunk_size=``,
``collective_timeout=``, ...), the ``publisher:`` YAML section has its own
spelling (``chunk_mib``), and the parts inside (serving thread, collective
sender) want their own typed options. Both front doors build this object
(``PublisherOptions.from_keywords``, ``PublisherConfig.options``); it checks
every value in ``__post_init__`` (``ConfigError`` naming the keyword) and is then
passed whole, nested options (``ServerLimits``, ``CollectiveOptions``) included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from publisher.collective.collective_sender import CollectiveOptions, check_options
from publisher.serving.server import ServerLimits
from publisher.store.chunk_sizing import chunk_size_for
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError
from weightpub_wire.peer_protocol import MAX_STRIPES

__all__ = ["PublisherKeywords", "PublisherOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PublisherOptions:
    """A publisher's options (see ``WeightPublisher`` for what each one does).

    ``collective`` is None (no collective path) or the path's options; its ``host``
    None means the endpoint's host. ``limits.tracker.fanout`` is ``peer_fanout``.
    ``chunk_size`` None (the default): each version's chunk follows its size
    (``publisher.store.chunk_sizing``; ``chunk_size_for`` says which).
    """

    model_id: str = ""
    #: snapshots held whole (each one version's bytes of host memory, in
    #: ``host_budget_bytes``); None: 1, or 2 with ``delta_anchor_every`` > 1 (``versions_kept``)
    keep_versions: int | None = None
    chunk_size: int | None = None
    heartbeat_interval: float = 1.0
    first_version: int = 1
    delta_anchor_every: int = 1
    curve_secret_key_file: str | None = None
    curve_allowed_clients_dir: str | None = None
    insecure: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    collective: CollectiveOptions | None = None
    #: None: derived from the memory available at start (``publisher.store.host_budget``)
    host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (
                isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                or not wire.MIN_CHUNK_SIZE <= self.chunk_size <= wire.MAX_CHUNK_SIZE):
            raise ConfigError(f"chunk_size: {self.chunk_size} is outside "
                              f"[{wire.MIN_CHUNK_SIZE}, {wire.MAX_CHUNK_SIZE}] (or None: "
                              "chosen per version from its size)")
        if self.keep_versions is not None and self.keep_versions < 1:
            raise ConfigError(f"keep_versions: {self.keep_versions} must be >= 1")
        if self.delta_anchor_every > 1 and self.keep_versions == 1:
            raise ConfigError(
                f"keep_versions: 1 with delta_anchor_every {self.delta_anchor_every}: a delta "
                "is encoded against the previous version, kept whole beside the new one, so "
                "deltas need keep_versions >= 2 (one more snapshot of host memory, counted in "
                "host_budget_bytes; leave keep_versions unset for 2)")
        if self.first_version < 1:
            raise ConfigError(f"first_version: {self.first_version} must be >= 1")
        if not 0 < self.heartbeat_interval <= 3600:
            raise ConfigError(f"heartbeat_interval: {self.heartbeat_interval} is outside "
                              "(0, 3600]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not a port")
        if self.collective is not None:
            check_options(self.collective, self.chunk_size)
        budget = self.host_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            raise ConfigError(f"host_budget_bytes: {budget!r} must be a positive number of "
                              "bytes (or None: derived from the memory available)")

    def chunk_size_for(self, total_bytes: int) -> int:
        """The chunk size of a version of ``total_bytes``: ``chunk_size``, or adaptive."""
        return chunk_size_for(self.chunk_size, total_bytes)

    @property
    def versions_kept(self) -> int:
        """``keep_versions``, or its default: 1 (one snapshot, overwritten by the next
        version), 2 with deltas (their base stays whole)."""
        if self.keep_versions is not None:
            return self.keep_versions
        return 2 if self.delta_anchor_every > 1 else 1

    @classmethod
    def from_keywords(cls, **keywords: Unpack[PublisherKeywords]) -> PublisherOptions:
        """The options of ``WeightPublisher(endpoint, **keywords)``; ``ConfigError`` names
        an unknown keyword or a bad value."""
        unknown = set(keywords) - set(PublisherKeywords.__annotations__)
        if unknown:
            raise ConfigError(f"WeightPublisher: unknown option(s) {sorted(unknown)} (known: "
                              f"{sorted(PublisherKeywords.__annotations__)})")
        given: dict[str, Any] = dict(keywords)
        collective = _collective(given)  # pops every collective_* keyword
        fanout = given.pop("peer_fanout", None)
        limits: ServerLimits = given.pop("limits", None) or ServerLimits()
        if fanout is not None:  # (TrackerLimits checks it too, under its own name)
            if not 0 <= fanout <= MAX_STRIPES:
                raise ConfigError(f"peer_fanout: {fanout} is outside [0, {MAX_STRIPES}]")
            limits = dataclasses.replace(limits, tracker=dataclasses.replace(
                limits.tracker, fanout=fanout))
        return cls(**given, limits=limits, collective=collective)


class PublisherKeywords(TypedDict, total=False):
    """``WeightPublisher``'s option keywords (the flat, public spelling)."""

    model_id: str
    keep_versions: int | None
    chunk_size: int | None
    heartbeat_interval: float
    first_version: int
    delta_anchor_every: int
    curve_secret_key_file: str | None
    curve_allowed_clients_dir: str | None
    insecure: bool
    limits: ServerLimits | None
    peer_fanout: int | None
    metrics_port: int | None
    metrics_host: str
    collective: str | None
    collective_bucket_bytes: int
    collective_timeout: float
    collective_port: int
    collective_host: str | None
    collective_device: str | None
    host_budget_bytes: int | None


def _collective(given: dict[str, Any]) -> CollectiveOptions | None:
    """``CollectiveOptions`` from the ``collective*`` keywords (removed from ``given``)."""
    backend = given.pop("collective", None)
    fields = {name: given.pop(f"collective_{name}") for name in
              ("bucket_bytes", "timeout", "port", "host", "device")
              if f"collective_{name}" in given}
    if backend is None:
        return None  # the collective_* keywords only shape a path that is on
    if fields.get("host") == "*":
        fields["host"] = "0.0.0.0"
    return CollectiveOptions(backend=str(backend), **fields)
