"""The wire both sides of weightpub speak: messages, checks, dtypes, endpoints, sockets.

Nothing here knows about trainers or vLLM; ``publisher`` and ``subscriber_ext``
import this package and never each other. See ``weightpub_wire.protocol`` for
the frames.
"""

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
    "ApplyError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "Manifest",
    "ProtocolError",
    "Report",
    "StagingBudgetError",
    "TensorEntry",
    "TransportError",
    "VersionUnavailable",
    "WeightPubError",
    "WeightPubTimeout",
]
