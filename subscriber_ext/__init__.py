"""weightpub, inference side: subscribe, stage, and apply weights inside vLLM.

``WeightSubscriber`` works without vLLM; the vLLM worker extension is imported
lazily so that importing this package never pulls in vLLM.
"""

from typing import Any as _Any

from subscriber_ext.staging import StagedVersion
from subscriber_ext.subscriber import WeightSubscriber
from subscriber_ext.sync_client import SyncOptions

__all__ = ["BatchWeightSyncWorkerExtension", "StagedVersion", "SyncOptions", "WeightSubscriber"]


def __getattr__(name: str) -> _Any:
    if name == "BatchWeightSyncWorkerExtension":
        from subscriber_ext.worker_extension import BatchWeightSyncWorkerExtension

        return BatchWeightSyncWorkerExtension
    raise AttributeError(name)
