"""One exception hierarchy for both sides of the wire.

::

    WeightPubError
     ├── ProtocolError        a message broke the wire rules (names the field)
     │    └── ProtocolVersionError   the peer speaks another protocol version (names both)
     ├── ChecksumError        a chunk kept failing its checksum; the version was given up
     ├── TransportError       a socket could not be bound or connected
     ├── WeightPubTimeout     a bounded wait ran out (also a ``TimeoutError``)
     ├── VersionUnavailable   the publisher no longer holds that version
     ├── ConfigError          a config file or option is invalid (names the key)
     ├── ApplyError           a staged version cannot be applied to the model
     ├── StagingBudgetError   a version does not fit the host-memory budget for staging
     └── ClosedError          the object was used after ``close()``

Lower-level errors (msgpack, zmq, torch) are re-raised as one of these with
``raise ... from exc`` so callers catch one family.
"""

from __future__ import annotations

__all__ = [
    "ApplyError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "ProtocolError",
    "ProtocolVersionError",
    "StagingBudgetError",
    "TransportError",
    "VersionUnavailable",
    "WeightPubError",
    "WeightPubTimeout",
]


class WeightPubError(Exception):
    """Base class of every error weightpub raises on purpose."""


class ProtocolError(WeightPubError):
    """A message from the network is malformed; the message names the field."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks protocol ``theirs``, this side ``ours``: nothing it sends is used."""

    def __init__(self, what: str, theirs: int, ours: int) -> None:
        super().__init__(f"{what}: protocol version {theirs} from the peer, this side "
                         f"speaks {ours}")
        self.what = what
        self.theirs = theirs
        self.ours = ours


class ChecksumError(WeightPubError):
    """Received bytes kept failing the checksum the manifest announced."""


class TransportError(WeightPubError):
    """A socket could not be bound or connected (address in use, bad interface, ...)."""


class WeightPubTimeout(WeightPubError, TimeoutError):
    """A bounded wait ran out before its condition was met."""


class VersionUnavailable(WeightPubError):
    """The publisher has evicted (or never had) the requested version."""


class ConfigError(WeightPubError, ValueError):
    """A configuration value is invalid; the message names the key."""


class ApplyError(WeightPubError):
    """A staged version does not fit the model; the message names the tensor."""


class StagingBudgetError(WeightPubError):
    """A version needs more staging memory than the budget allows; refused before
    allocating (the live weights stay as they are)."""


class ClosedError(WeightPubError):
    """The publisher or subscriber was used after ``close()``."""
