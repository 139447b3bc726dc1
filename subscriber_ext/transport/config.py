"""The subscriber's YAML section (``subscriber:`` inside replica and relay files)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from weightpub_wire.config_file import StrictConfig, check_endpoint

__all__ = ["SubscriberConfig"]


class SubscriberConfig(StrictConfig):
    """Inference side transport options (map onto ``SyncOptions``)."""

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

    _endpoint = field_validator("endpoint")(check_endpoint)

    @model_validator(mode="after")
    def _client_key_needs_server_key(self) -> SubscriberConfig:
        if self.curve_secret_key_file is not None and self.curve_server_key_file is None:
            raise ValueError("curve_secret_key_file needs curve_server_key_file (the "
                             "publisher's public key); without it the client key is unused")
        return self

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
        return kwargs
