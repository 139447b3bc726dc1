"""Deployment YAML files: which kinds exist and how each is loaded.

Each side owns its section's schema (``publisher.PublisherConfig``,
``subscriber_ext.SubscriberConfig``); replicas and relays, which only the
application starts, are defined here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from publisher.publisher_config import PublisherConfig
from subscriber_ext.transport.subscriber_config import SubscriberConfig
from subscriber_ext.vllm_ext.apply.applier import ApplyMode
from subscriber_ext.vllm_ext.receive_choice import ReceiveMode
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from weightpub_wire.config_file import StrictConfig, load_yaml_as, load_yaml_section
from weightpub_wire.option_set import declared

__all__ = [
    "KINDS",
    "PublisherConfig",
    "RelayConfig",
    "ReplicaConfig",
    "SubscriberConfig",
    "load_config",
    "load_relay_config",
    "load_replica_config",
]


class ReplicaConfig(StrictConfig):
    """A vLLM replica that follows a publisher."""

    model: str
    subscriber: SubscriberConfig
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # the worker extension's options, as WorkerOptions declares them (type, bound, default)
    apply_mode: ApplyMode = declared(WorkerOptions, "apply_mode")
    node_staging: bool | None = declared(WorkerOptions, "node_staging")
    receive: ReceiveMode = declared(WorkerOptions, "receive")
    prepare_budget_bytes: int | None = declared(WorkerOptions, "prepare_budget_bytes")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list)


class RelayConfig(StrictConfig):
    """Re-publishes an upstream publisher's versions to a local fan-out tier."""

    upstream: SubscriberConfig
    downstream: PublisherConfig
    # forward each chunk as soon as it verifies (False: receive whole versions, then publish)
    cut_through: bool = True


KINDS: dict[str, type[BaseModel]] = {
    "publisher": PublisherConfig,
    "replica": ReplicaConfig,
    "relay": RelayConfig,
}


def load_config(path: str | Path) -> BaseModel:
    """Load any deployment file; its top-level key (``publisher:``, ...) names its kind."""
    return load_yaml_section(path, KINDS)


def load_replica_config(path: str | Path) -> ReplicaConfig:
    return load_yaml_as(path, "replica", ReplicaConfig)


def load_relay_config(path: str | Path) -> RelayConfig:
    return load_yaml_as(path, "relay", RelayConfig)
