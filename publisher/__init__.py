"""weightpub, trainer side: snapshot, version and serve weights over ZeroMQ.

The wire protocol both sides speak lives in ``publisher.protocol``.
"""

from publisher.errors import (
    ApplyError,
    ChecksumError,
    ClosedError,
    ConfigError,
    ProtocolError,
    VersionUnavailable,
    WeightPubError,
    WeightPubTimeout,
)
from publisher.protocol import PROTOCOL_VERSION, Manifest, TensorEntry
from publisher.snapshot import gather_full_tensors
from publisher.weight_publisher import WeightPublisher

__all__ = [
    "PROTOCOL_VERSION",
    "ApplyError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "Manifest",
    "ProtocolError",
    "TensorEntry",
    "VersionUnavailable",
    "WeightPubError",
    "WeightPubTimeout",
    "WeightPublisher",
    "gather_full_tensors",
]
