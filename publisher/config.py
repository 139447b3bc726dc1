"""YAML configuration for publishers, replicas and relays, validated at load.

The same files start a laptop demo and a cluster deployment. Validation is
pydantic's (strict types, unknown keys rejected); every failure is re-raised
as ``ConfigError`` naming the file and the key path, e.g.
``configs/replica.yaml: subscriber.window_mib: Input should be greater than 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from publisher.endpoints import parse_endpoint
from publisher.errors import ConfigError

__all__ = [
    "PublisherConfig",
    "RelayConfig",
    "ReplicaConfig",
    "SubscriberConfig",
    "load_config",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_endpoint(value: str) -> str:
    parse_endpoint(value)  # raises ConfigError with the reason
    return value


class PublisherConfig(_Strict):
    """Trainer side: where to serve and how many versions to keep."""

    endpoint: str
    model_id: str = ""
    keep_versions: int = Field(2, ge=1, le=64)
    chunk_mib: int = Field(4, ge=1, le=1024)
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    first_version: int = Field(1, ge=1)
    curve_secret_key_file: str | None = None  # zmq certificate: turns on CurveZMQ
    curve_allowed_clients_dir: str | None = None  # only these client keys may connect

    _endpoint = field_validator("endpoint")(_check_endpoint)

    def publisher_kwargs(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "keep_versions": self.keep_versions,
            "chunk_size": self.chunk_mib << 20,
            "heartbeat_interval": self.heartbeat_interval,
            "first_version": self.first_version,
            "curve_secret_key_file": self.curve_secret_key_file,
            "curve_allowed_clients_dir": self.curve_allowed_clients_dir,
        }


class SubscriberConfig(_Strict):
    """Inference side transport options (map onto ``SyncOptions``)."""

    endpoint: str
    request_timeout: float = Field(5.0, gt=0, le=600)
    window_mib: int = Field(64, ge=1, le=65536)
    max_chunk_retries: int = Field(5, ge=0, le=1000)
    max_version_gib: float = Field(1024.0, gt=0)
    curve_server_key_file: str | None = None  # the publisher's public key: turns on CurveZMQ
    curve_secret_key_file: str | None = None  # this client's key pair (allow-listing)

    _endpoint = field_validator("endpoint")(_check_endpoint)

    def subscriber_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``WeightSubscriber`` (JSON-able: they also travel in
        vLLM's ``--additional-config``)."""
        kwargs: dict[str, Any] = {
            "request_timeout": self.request_timeout,
            "window_bytes": self.window_mib << 20,
            "max_chunk_retries": self.max_chunk_retries,
            "max_version_bytes": int(self.max_version_gib * (1 << 30)),
        }
        if self.curve_server_key_file is not None:
            kwargs["curve_server_key_file"] = self.curve_server_key_file
            kwargs["curve_secret_key_file"] = self.curve_secret_key_file
        return kwargs


class ReplicaConfig(_Strict):
    """A vLLM replica that follows a publisher."""

    model: str
    subscriber: SubscriberConfig
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    apply_mode: Literal["auto", "in_place", "reload"] = "auto"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list)


class RelayConfig(_Strict):
    """Re-publishes an upstream publisher's versions to a local fan-out tier."""

    upstream: SubscriberConfig
    downstream: PublisherConfig


_KINDS: dict[str, type[_Strict]] = {
    "publisher": PublisherConfig,
    "replica": ReplicaConfig,
    "relay": RelayConfig,
}


def load_config(path: str | Path, kind: str | None = None) -> _Strict:
    """Load a YAML file whose top-level key (``publisher:``, ``replica:`` or ``relay:``)
    names its kind; ``kind`` restricts which is accepted."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(f"{path}: expected exactly one top-level key: {', '.join(_KINDS)}")
    (found, body), = raw.items()
    if found not in _KINDS:
        raise ConfigError(f"{path}: unknown top-level key {found!r} (expected one of "
                          f"{', '.join(_KINDS)})")
    if kind is not None and found != kind:
        raise ConfigError(f"{path}: is a {found!r} config, expected {kind!r}")
    try:
        return _KINDS[found].model_validate(body or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{found}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from exc
