"""``SubscriberOptions``: every option of a ``WeightSubscriber``, declared once, checked once.

Why one flat object: the subscriber's keywords (``window_bytes=``, ``peer_share=``,
``max_version_bytes=``, ...), its ``subscriber:`` YAML section
(``subscriber_config.py``, the same model with ``endpoint`` beside it) and vLLM's
``init_info`` (through ``WorkerOptions``, which extends this class) all give the same
names, so they are one ``OptionSet``: ``SyncSettings`` (how chunks are fetched) +
``PeerSettings`` (peer sharing) + the fields below. Each is declared once, with its
bound, default, unit and doc; ``sync`` is the ``SyncOptions`` the client runs with,
built from them once. The worker extension builds this on every rank before
anything starts, so a bad option fails the same way everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self, TypedDict

import msgspec
from pydantic import Field, InstanceOf, PrivateAttr, field_validator, model_validator

from subscriber_ext.transport.client.sync_options import SyncOptions, SyncSettings
from subscriber_ext.transport.peers.peer_options import PeerSettings
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError
from weightpub_wire.option_set import unit
from weightpub_wire.slice_plan import SlicePlan

__all__ = ["SubscriberKeywords", "SubscriberOptions"]


class SubscriberOptions(SyncSettings, PeerSettings):
    """A subscriber's options (``WeightSubscriber``'s docstring says what each one does)."""

    option_owner = "WeightSubscriber"

    subscriber_id: str | None = Field(
        None, description="the name in every report (default: host, pid and a random tag)")
    curve_server_key_file: str | None = Field(
        None, description="the publisher's public key: turns on CurveZMQ")
    curve_secret_key_file: str | None = Field(
        None, description="this client's key pair (the publisher's allow-list)")
    staging_budget_bytes: int | None = Field(
        None, ge=1, json_schema_extra=unit("bytes"),
        description="host memory for staged versions, all alive at once (default: half of "
                    "what is available at start)")
    max_version_bytes: int | None = Field(
        None, ge=1, json_schema_extra=unit("bytes", yaml="max_version_gib"),
        description="refuse larger manifests before allocating (default: this machine's "
                    "memory)")
    limits: InstanceOf[wire.Limits] | None = Field(
        None, json_schema_extra=unit("", python_only=True),
        description="receiver bounds (default: weightpub_wire Limits); max_version_bytes "
                    "replaces its max_total_bytes")
    slice_plan: InstanceOf[SlicePlan] | None = Field(
        None, json_schema_extra=unit("", python_only=True),
        description="fetch only these bytes of each version (weightpub_wire SlicePlan, "
                    "issue 30): staged into a full-size sparse buffer, data_path 'slices'; "
                    "with peer_share, shared with peers of the same plan; not with "
                    "collective")
    _sync: SyncOptions = PrivateAttr()

    @field_validator("subscriber_id")
    @classmethod
    def _wire_name(cls, value: str | None) -> str | None:
        if value is not None:  # the id travels in every report: refuse what the publisher would
            try:
                msgspec.convert(value, wire.Name)
            except msgspec.ValidationError as exc:
                raise ValueError(str(exc)) from exc
        return value

    @model_validator(mode="after")
    def _client_key_needs_server_key(self) -> Self:
        if self.curve_secret_key_file is not None and self.curve_server_key_file is None:
            raise ValueError(
                "curve_secret_key_file: given without curve_server_key_file (the publisher's "
                "public key); CURVE needs both, and this client key would be ignored")
        return self

    @model_validator(mode="after")
    def _slices_alone(self) -> Self:
        if self.slice_plan is not None:
            if self.collective:
                raise ValueError(
                    "slice_plan: given with collective=True; a sliced subscriber holds only "
                    "its planned bytes, which collective does not serve yet (issue 30)")
        return self

    def model_post_init(self, context: Any, /) -> None:
        limits = self.limits if self.limits is not None else wire.Limits()
        if self.max_version_bytes is not None:
            limits = dataclasses.replace(limits, max_total_bytes=self.max_version_bytes)
        self._sync = SyncOptions(**self.given(SyncSettings.model_fields), limits=limits,
                                 peers=self.peer_options())

    @property
    def sync(self) -> SyncOptions:
        """What ``SyncClient`` runs with (built once from these options)."""
        return self._sync

    @classmethod
    def from_keywords(cls, **keywords: Any) -> Self:
        """``WeightSubscriber``'s keywords; ``sync`` (a ``SyncOptions``) is a base they
        override."""
        base = keywords.pop("sync", None)
        if base is not None:
            if not isinstance(base, SyncOptions):
                raise ConfigError(f"sync: {base!r} is not a SyncOptions")
            inherited: dict[str, Any] = base.given(SyncSettings.model_fields)
            inherited["limits"] = base.limits
            if base.peers is not None:
                peers = base.peers
                inherited.update(peer_share=True, peer_bind=peers.bind, insecure=peers.insecure,
                                 upload_mbit=None if peers.upload_bytes_per_s is None
                                 else peers.upload_bytes_per_s * 8 / 1e6)
                if peers.upload_cpu_share is not None:
                    inherited["upload_cpu_share"] = peers.upload_cpu_share
            keywords = {**inherited, **keywords}
        return super().from_keywords(**keywords)

    def subscriber_kwargs(self) -> dict[str, Any]:
        """The options as keywords a file or the network may carry (JSON-able: no
        Python-only ones), those that differ from their default."""
        declared = SubscriberOptions.declared_options()
        return {name: getattr(self, name) for name, info in declared.items()
                if getattr(self, name) != info.default}


class SubscriberKeywords(TypedDict, total=False):
    """``WeightSubscriber``'s option keywords, for type checkers; a test holds it equal to
    ``SubscriberOptions``' declaration (plus ``sync``, a ``SyncOptions`` base)."""

    request_timeout: float
    window_bytes: int
    chunks_per_request: int
    max_chunk_retries: int
    switch_below_fraction: float
    report_interval: float
    collective: bool
    collective_device: str | None
    nixl: bool | None
    stream: bool
    peer_share: bool
    peer_bind: str | None
    insecure: bool
    upload_mbit: float | None
    upload_cpu_share: float
    subscriber_id: str | None
    curve_server_key_file: str | None
    curve_secret_key_file: str | None
    staging_budget_bytes: int | None
    max_version_bytes: int | None
    limits: wire.Limits | None
    slice_plan: SlicePlan | None
    sync: SyncOptions | None
