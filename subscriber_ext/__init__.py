"""weightpub, inference side: subscribe, stage, and apply weights inside vLLM.

``WeightSubscriber`` works without vLLM; the vLLM worker extension is imported
lazily so that importing this package never pulls in vLLM.

Layers (imports point down): ``worker_extension`` / ``seed_rpcs`` (the RPCs) ->
``commit/`` (when every rank switches) -> ``apply/`` (how tensors reach vLLM
parameters) and ``seed/``; ``transport/`` (subscribe, fetch, verify, stage) ->
``weightpub_wire``. ``staleness`` tells which policy versions produced a sample
(for RL actors and learners).
"""

from typing import Any as _Any

from subscriber_ext.staleness import (
    VersionRange,
    keep_fresh,
    request_version_range,
    version_range,
)
from subscriber_ext.transport.client.sync_client import SyncOptions
from subscriber_ext.transport.staging.assembly import StagedVersion
from subscriber_ext.transport.subscriber import WeightSubscriber
from subscriber_ext.transport.subscriber_config import SubscriberConfig
from subscriber_ext.vllm_ext.llm import WORKER_EXTENSION, replica_status, wait_until_applied
from subscriber_ext.vllm_ext.lora.requests import adapter_request

__all__ = [
    "WORKER_EXTENSION",
    "BatchWeightSyncWorkerExtension",
    "StagedVersion",
    "SubscriberConfig",
    "SyncOptions",
    "VersionRange",
    "WeightSubscriber",
    "adapter_request",
    "keep_fresh",
    "replica_status",
    "request_version_range",
    "version_range",
    "wait_until_applied",
]


def __getattr__(name: str) -> _Any:
    if name == "BatchWeightSyncWorkerExtension":
        from subscriber_ext.vllm_ext.worker_extension import BatchWeightSyncWorkerExtension

        return BatchWeightSyncWorkerExtension
    raise AttributeError(name)
