"""The ``publisher:`` YAML section: the trainer side's options, validated at load."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from publisher.publisher_options import PublisherKeywords, PublisherOptions
from publisher.store.chunk_sizing import LARGEST as LARGEST_CHUNK
from weightpub_wire.config_file import StrictConfig, check_endpoint, load_yaml_as

__all__ = ["PublisherConfig", "ShardingConfig", "load_publisher_config"]


class ShardingConfig(StrictConfig):
    """A sharded trainer (``ShardedPublisher.from_config``): every rank reads the same file."""

    # where the ranks send their shards: rank 0 binds it, the others dial it
    coordinator: str
    announce_endpoint: str  # what replicas dial (rank 0's coordinator serves it)
    shard_timeout: float = Field(30.0, gt=0, le=3600)  # a version's shards all in by then
    # where replicas reach this rank's shard (default: endpoint as bound, this host's name)
    advertise: str | None = None

    _endpoints = field_validator("coordinator", "announce_endpoint")(check_endpoint)


class PublisherConfig(StrictConfig):
    """Trainer side: where to serve and how many versions to keep."""

    endpoint: str
    model_id: str = ""
    # snapshots held whole (None: 1, or 2 with delta_anchor_every > 1; PublisherOptions)
    keep_versions: int | None = Field(None, ge=1, le=64)
    # chunk size on the wire; 0 (default): chosen per version from its size, a power of
    # two from 256 KiB to 4 MiB giving at least 64 chunks (publisher.store.chunk_sizing)
    chunk_mib: int = Field(0, ge=0, le=1024)
    heartbeat_interval: float = Field(1.0, gt=0, le=60)
    first_version: int = Field(1, ge=1)
    delta_anchor_every: int = Field(1, ge=1, le=64)  # >1: deltas, a full version every N
    curve_secret_key_file: str | None = None  # zmq certificate: turns on CurveZMQ
    curve_allowed_clients_dir: str | None = None  # only these client keys may connect
    metrics_port: int | None = Field(None, ge=0, le=65535)  # Prometheus /metrics (0: any)
    metrics_host: str = "127.0.0.1"
    insecure: bool = False  # allow a non-loopback bind without CURVE (trusted networks only)
    # also send every version by a group broadcast to the subscribers that ask (None: off)
    collective: Literal["gloo", "nccl", "cuda_ipc"] | None = None
    collective_bucket_mib: int = Field(64, ge=1, le=1024)  # a multiple of chunk_mib (or 4)
    collective_timeout: float = Field(30.0, gt=1.0, le=3600)  # any rendezvous or collective
    collective_port: int = Field(0, ge=0, le=65535)  # the rendezvous (0: any free port)
    collective_host: str | None = None  # where members reach us (default: endpoint's host)
    collective_device: str | None = None  # nccl / cuda_ipc: e.g. "cuda:0"
    peer_fanout: int = Field(4, ge=0, le=16)  # peer sharing: stripes per version (0: off)
    # host memory for version snapshots (None: 3/4 of what is available at start)
    host_budget_bytes: int | None = Field(None, ge=1)
    # every trainer rank publishes its own shard (ShardedPublisher.from_config; None: off)
    sharding: ShardingConfig | None = None

    _endpoint = field_validator("endpoint")(check_endpoint)

    @model_validator(mode="after")
    def _buckets_are_whole_chunks(self) -> PublisherConfig:
        chunk_mib = self.chunk_mib or LARGEST_CHUNK >> 20
        if self.collective_bucket_mib % chunk_mib:
            what = f"chunk_mib {self.chunk_mib}" if self.chunk_mib else \
                f"{chunk_mib} (chunk_mib 0: chunks chosen per version, up to {chunk_mib} MiB)"
            raise ValueError(f"collective_bucket_mib {self.collective_bucket_mib} is not a "
                             f"multiple of {what}")
        return self

    def options(self) -> PublisherOptions:
        """The ``WeightPublisher``'s options (the endpoint is passed beside them)."""
        return PublisherOptions.from_keywords(**self.keywords())

    def keywords(self) -> PublisherKeywords:
        """The same options as ``WeightPublisher``'s keywords (``ShardedPublisher`` takes
        these)."""
        return PublisherKeywords(
            model_id=self.model_id, keep_versions=self.keep_versions,
            chunk_size=(self.chunk_mib << 20) or None, heartbeat_interval=self.heartbeat_interval,
            first_version=self.first_version, delta_anchor_every=self.delta_anchor_every,
            curve_secret_key_file=self.curve_secret_key_file,
            curve_allowed_clients_dir=self.curve_allowed_clients_dir,
            metrics_port=self.metrics_port, metrics_host=self.metrics_host,
            insecure=self.insecure, collective=self.collective,
            collective_bucket_bytes=self.collective_bucket_mib << 20,
            collective_timeout=self.collective_timeout, collective_port=self.collective_port,
            collective_host=self.collective_host, collective_device=self.collective_device,
            peer_fanout=self.peer_fanout, host_budget_bytes=self.host_budget_bytes)


def load_publisher_config(path: str | os.PathLike[str]) -> PublisherConfig:
    """Read a file whose top-level key is ``publisher:``."""
    return load_yaml_as(path, "publisher", PublisherConfig)
