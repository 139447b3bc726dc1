"""The worker extension's public import path (``subscriber_ext.WORKER_EXTENSION``).

Kept so that every deployment naming
``subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension`` keeps
working; the code lives in ``subscriber_ext.vllm_ext.worker_extension``.
"""

from subscriber_ext.vllm_ext.worker_extension import BatchWeightSyncWorkerExtension

__all__ = ["BatchWeightSyncWorkerExtension"]
