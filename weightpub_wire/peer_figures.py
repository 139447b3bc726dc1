"""A peer-sharing member's peer counters as its ``Report`` carries them, and their sum.

Why: a member counts what it took from peers and gave them over NIXL (issue 31,
``docs/peers-over-nixl.md``) and over the peers' stream ports (``docs/peer-stream.md``);
the publisher sums each kind over its fleet. Both kinds are a few counts and one set of
causes, so one struct shape carries the bounds, the check, the fold from a member's
status and the fleet sum, and each kind only names its fields.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from msgspec import Meta

from weightpub_wire.message_base import U63

__all__ = ["MAX_PEER_CAUSES", "PeerFigures", "PeerNixlFigures", "PeerStreamFigures",
           "peer_total"]

#: causes one figures struct carries at most (a member folds its own to fit)
MAX_PEER_CAUSES = 16
PeerCause = Annotated[str, Meta(min_length=1, max_length=32, pattern="^[a-z0-9_]+$")]
PeerCauses = Annotated[tuple[tuple[PeerCause, U63], ...], Meta(max_length=MAX_PEER_CAUSES)]
_MAX_COUNT = (1 << 63) - 1
_PLAIN = re.compile("^[a-z0-9_]{1,32}$")

F = TypeVar("F", bound="PeerFigures")


class PeerFigures(msgspec.Struct, frozen=True, kw_only=True):
    """Counts since the member started: chunk bytes and chunks it took from peers and
    verified, and (in each kind) what it gave and one field of counts by cause, named
    by ``CAUSES``. Every count is a ``U63`` (negative, fractional or past 2**63 - 1 is
    refused naming the field), 16 causes at most, each a plain word named once."""

    #: the kind's field of counts by cause
    CAUSES: ClassVar[str] = ""

    bytes_from_peers: U63 = 0
    chunks_from_peers: U63 = 0

    def __post_init__(self) -> None:
        causes = [cause for cause, _ in self.causes()]
        if len(set(causes)) != len(causes):
            raise ValueError(f"{self.CAUSES}: a cause named twice ({sorted(causes)})")

    def causes(self) -> tuple[tuple[str, int], ...]:
        causes: tuple[tuple[str, int], ...] = getattr(self, self.CAUSES)
        return causes

    @classmethod
    def bounded(cls: type[F], counts: Mapping[str, Any], causes: Mapping[Any, Any]) -> F:
        """Figures within the wire's bounds whatever ``counts`` (field -> count, a
        missing one 0) and ``causes`` hold: a count clamped to 0..2**63 - 1, a cause
        that is not a plain word counted as ``other``, the first 16 causes kept."""
        kept: dict[str, int] = {}
        for cause, count in causes.items():
            key = cause if isinstance(cause, str) and _PLAIN.match(cause) else "other"
            if key in kept or len(kept) < MAX_PEER_CAUSES:
                kept[key] = _clamp(kept.get(key, 0) + int(count))
        fields: dict[str, Any] = {name: _clamp(int(counts.get(name, 0)))
                                  for name in cls.__struct_fields__}
        fields[cls.CAUSES] = tuple(sorted(kept.items()))
        return cls(**fields)


class PeerNixlFigures(PeerFigures, frozen=True, kw_only=True):
    """Peers over NIXL (issue 31): chunks READ from peers (``bytes_from_peers``,
    ``chunks_from_peers``), ``peer_nixl`` questions answered with an offer, and those
    answered None by cause (``frames``, ``sliced``, ``budget``...)."""

    CAUSES: ClassVar[str] = "unoffered"

    offers: U63 = 0
    unoffered: PeerCauses = ()


class PeerStreamFigures(PeerFigures, frozen=True, kw_only=True):
    """Peers over the stream (``docs/peer-stream.md``): chunks received on peers'
    stream ports (``bytes_from_peers``, ``chunks_from_peers``), chunks its own port
    sent (``bytes_served``, ``chunks_served``), and chunks given back to frames by cause
    (``refused``, ``no_answer``, ``closed``, ``checksum``...)."""

    CAUSES: ClassVar[str] = "fallbacks"

    bytes_served: U63 = 0
    chunks_served: U63 = 0
    fallbacks: PeerCauses = ()


def peer_total(figures: Iterable[F | None]) -> F | None:
    """The figures summed field by field (each sum at most 2**63 - 1; causes: the first
    16 met), None when there are none (no member counts that kind, or every report
    predates the field)."""
    carried = [f for f in figures if f is not None]
    if not carried:
        return None
    kind = type(carried[0])
    counts: dict[str, int] = {}
    causes: dict[str, int] = {}
    for each in carried:
        for name in kind.__struct_fields__:
            if name != kind.CAUSES:
                counts[name] = counts.get(name, 0) + getattr(each, name)
        for cause, count in each.causes():
            causes[cause] = causes.get(cause, 0) + count
    return kind.bounded(counts, causes)


def _clamp(count: int) -> int:
    return min(_MAX_COUNT, max(0, count))
