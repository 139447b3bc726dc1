"""``SubscriberOptions``: everything a ``WeightSubscriber`` is configured with, checked once.

Why one object: the subscriber takes flat keywords (``window_bytes=``,
``peer_share=``, ``max_version_bytes=``, ...), which land in nested typed
options (``SyncOptions``, ``PeerOptions``, ``wire.Limits``). They are turned
into this object once, by ``SubscriberOptions.from_keywords`` (``ConfigError``
naming the keyword), and the object is passed whole: the worker extension builds
it on every rank before anything starts (so a bad option fails the same way
everywhere) and hands it to the node's owner; the subscriber module keeps only
the thread and its API.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import msgspec

from subscriber_ext.transport.client.sync_client import SyncOptions
from subscriber_ext.transport.peers.peer_options import PeerOptions
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError

__all__ = ["SubscriberOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriberOptions:
    """A subscriber's options (see ``WeightSubscriber`` for what each one does).

    ``subscriber_id`` None: a fresh one per subscriber (host, pid, random).
    ``staging_budget_bytes`` None: half of the memory available at start.
    """

    sync: SyncOptions = field(default_factory=SyncOptions)
    subscriber_id: str | None = None
    curve_server_key_file: str | None = None  # the publisher's public key: CurveZMQ on
    curve_secret_key_file: str | None = None  # this client's key pair (allow-listing)
    staging_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        budget = self.staging_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget <= 0):
            raise ConfigError(f"staging_budget_bytes: {budget!r} is not a positive number "
                              "of bytes")
        if self.curve_secret_key_file is not None and self.curve_server_key_file is None:
            raise ConfigError(
                "curve_secret_key_file: given without curve_server_key_file (the publisher's "
                "public key); CURVE needs both, and this client key would be ignored")
        if self.subscriber_id is not None:
            try:  # the id travels in every report: refuse here what the publisher would
                msgspec.convert(self.subscriber_id, wire.Name)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"subscriber_id: {exc}") from exc

    @classmethod
    def from_keywords(
        cls,
        *,
        sync: SyncOptions | None = None,
        subscriber_id: str | None = None,
        curve_server_key_file: str | None = None,
        curve_secret_key_file: str | None = None,
        staging_budget_bytes: int | None = None,
        max_version_bytes: int | None = None,
        peer_share: bool = False,
        peer_bind: str | None = None,
        insecure: bool | None = None,
        upload_mbit: float | None = None,
        upload_cpu_share: float | None = None,
        **sync_fields: Any,
    ) -> SubscriberOptions:
        """The options of ``WeightSubscriber(endpoint, **keywords)``.

        ``sync`` is the base the ``SyncOptions`` field keywords (``window_bytes``, ...)
        override; ``max_version_bytes`` bounds ``limits.max_total_bytes``; the peer
        keywords make ``sync.peers`` (only with ``peer_share=True``).
        """
        known = set(SyncOptions.__dataclass_fields__)
        unknown = set(sync_fields) - known - {"peers"}
        if unknown:
            own = [p for p in inspect.signature(cls.from_keywords).parameters
                   if p != "sync_fields"]
            raise ConfigError(f"WeightSubscriber: unknown option(s) {sorted(unknown)} "
                              f"(known: {sorted(known | set(own))})")
        peers = _peer_options(peer_share, bind=peer_bind, insecure=insecure,
                              upload_mbit=upload_mbit, upload_cpu_share=upload_cpu_share)
        if peers is not None:
            sync_fields["peers"] = peers
        base = sync or SyncOptions()
        if max_version_bytes is not None:
            limits = sync_fields.get("limits", base.limits)
            sync_fields["limits"] = dataclasses.replace(
                limits, max_total_bytes=int(max_version_bytes))
        return cls(sync=dataclasses.replace(base, **sync_fields) if sync_fields else base,
                   subscriber_id=subscriber_id, curve_server_key_file=curve_server_key_file,
                   curve_secret_key_file=curve_secret_key_file,
                   staging_budget_bytes=staging_budget_bytes)


def _peer_options(share: object, *, bind: str | None, insecure: bool | None,
                  upload_mbit: float | None,
                  upload_cpu_share: float | None) -> PeerOptions | None:
    """``PeerOptions`` from the peer keywords (None: peer sharing is off)."""
    if not isinstance(share, bool):
        raise ConfigError(f"peer_share: {share!r} is not true or false")
    if not share:
        given = {"peer_bind": bind, "insecure": insecure, "upload_mbit": upload_mbit,
                 "upload_cpu_share": upload_cpu_share}
        named = sorted(k for k, v in given.items() if v is not None)
        if named:
            raise ConfigError(f"{', '.join(named)}: only with peer_share=True")
        return None
    if upload_mbit is not None and (isinstance(upload_mbit, bool) or
                                    not isinstance(upload_mbit, int | float)
                                    or upload_mbit <= 0):
        raise ConfigError(f"upload_mbit: {upload_mbit!r} is not a positive number of Mbit/s")
    return PeerOptions(
        bind=bind, insecure=bool(insecure),
        upload_bytes_per_s=None if upload_mbit is None else upload_mbit * 1e6 / 8,
        upload_cpu_share=0.25 if upload_cpu_share is None else upload_cpu_share)
