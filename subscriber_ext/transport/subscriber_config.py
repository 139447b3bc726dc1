"""The subscriber's YAML section (``subscriber:`` inside replica and relay files)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from subscriber_ext.transport.subscriber_options import SubscriberOptions
from weightpub_wire.config_file import StrictConfig, check_endpoint

__all__ = ["SubscriberConfig"]


class SubscriberConfig(StrictConfig):
    """Inference side transport options (map onto ``SubscriberOptions``)."""

    endpoint: str
    request_timeout: float = Field(5.0, gt=0, le=600)
    window_mib: int = Field(64, ge=1, le=65536)
    max_chunk_retries: int = Field(5, ge=0, le=1000)
    # refuse manifests larger than this without allocating; default: this machine's memory
    max_version_gib: float | None = Field(None, gt=0)
    # host memory for staged versions (all alive at once); None: half of what is available
    staging_budget_bytes: int | None = Field(None, gt=0)
    curve_server_key_file: str | None = None  # the publisher's public key: turns on CurveZMQ
    curve_secret_key_file: str | None = None  # this client's key pair (allow-listing)
    # join the publisher's collective data path when it announces one (same fabric only)
    collective: bool = False
    # peer sharing: serve verified chunks to other subscribers, fetch from them as planned
    peer_share: bool = False
    peer_bind: str | None = None  # where to serve peers (default: derived, port 0)
    insecure: bool = False  # serve peers on a non-loopback address without CURVE
    upload_mbit: float | None = Field(None, gt=0)  # upload to peers at most this fast
    upload_cpu_share: float = Field(0.25, gt=0, le=64)  # of one core, for serving peers

    _endpoint = field_validator("endpoint")(check_endpoint)

    @field_validator("peer_bind")
    @classmethod
    def _peer_bind(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)

    @model_validator(mode="after")
    def _peer_options_need_peer_share(self) -> SubscriberConfig:
        given = [k for k in ("peer_bind", "upload_mbit") if getattr(self, k) is not None]
        if given and not self.peer_share:
            raise ValueError(f"{', '.join(given)} only apply with peer_share: true")
        return self

    @model_validator(mode="after")
    def _client_key_needs_server_key(self) -> SubscriberConfig:
        if self.curve_secret_key_file is not None and self.curve_server_key_file is None:
            raise ValueError("curve_secret_key_file needs curve_server_key_file (the "
                             "publisher's public key); without it the client key is unused")
        return self

    def subscriber_options(self) -> SubscriberOptions:
        """The ``WeightSubscriber``'s options (the endpoint is passed beside them)."""
        return SubscriberOptions.from_keywords(**self.subscriber_kwargs())

    def subscriber_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``WeightSubscriber`` (JSON-able: they also travel in
        vLLM's ``--additional-config``)."""
        kwargs: dict[str, Any] = {
            "request_timeout": self.request_timeout,
            "window_bytes": self.window_mib << 20,
            "max_chunk_retries": self.max_chunk_retries,
        }
        if self.max_version_gib is not None:
            kwargs["max_version_bytes"] = int(self.max_version_gib * (1 << 30))
        if self.staging_budget_bytes is not None:
            kwargs["staging_budget_bytes"] = self.staging_budget_bytes
        if self.curve_server_key_file is not None:
            kwargs["curve_server_key_file"] = self.curve_server_key_file
        if self.curve_secret_key_file is not None:
            kwargs["curve_secret_key_file"] = self.curve_secret_key_file
        if self.collective:
            kwargs["collective"] = True
        if self.peer_share:
            kwargs.update(peer_share=True, insecure=self.insecure,
                          upload_cpu_share=self.upload_cpu_share)
            if self.peer_bind is not None:
                kwargs["peer_bind"] = self.peer_bind
            if self.upload_mbit is not None:
                kwargs["upload_mbit"] = self.upload_mbit
        return kwargs
