"""weightpub, trainer side: snapshot, version and serve weights over ZeroMQ.

The wire protocol both sides speak lives in ``weightpub_wire``; the errors are
re-exported here so trainer code catches one family. ``PublishCallback`` (a
transformers ``TrainerCallback``) is imported on first use, so ``import publisher``
never pulls in transformers.
"""

from typing import Any as _Any

from publisher.adapters import AdapterSpec
from publisher.publisher_config import PublisherConfig
from publisher.serving.server import ServerLimits
from publisher.sharded_publisher import ShardedPublisher
from publisher.sources.streamed_copy import gather_full_tensors
from publisher.weight_publisher import WeightPublisher
from weightpub_wire.errors import (
    ApplyError,
    ChecksumError,
    ClosedError,
    ConfigError,
    ProtocolError,
    StagingBudgetError,
    TransportError,
    VersionUnavailable,
    WeightPubError,
    WeightPubTimeout,
)
from weightpub_wire.protocol import PROTOCOL_VERSION, Manifest, Report, TensorEntry

__all__ = [
    "PROTOCOL_VERSION",
    "AdapterSpec",
    "ApplyError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "Manifest",
    "ProtocolError",
    "PublishCallback",
    "PublisherConfig",
    "Report",
    "ServerLimits",
    "ShardedPublisher",
    "StagingBudgetError",
    "TensorEntry",
    "TransportError",
    "VersionUnavailable",
    "WeightPubError",
    "WeightPubTimeout",
    "WeightPublisher",
    "gather_full_tensors",
]


def __getattr__(name: str) -> _Any:
    if name == "PublishCallback":
        from publisher.callback import PublishCallback

        return PublishCallback
    raise AttributeError(name)
