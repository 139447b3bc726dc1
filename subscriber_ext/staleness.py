"""Which policy versions produced a sample, and which samples are too stale to learn from.

Off-policy RL actors keep generating while the learner trains, so one request can
run under several weight versions (a commit lands between two of its tokens). vLLM
reports that per completion as ``CompletionOutput.weight_versions``: a list of
``WeightVersionSpan(version, start, end)`` (output tokens ``[start, end)`` were
sampled by weights labelled ``version``; our engine driver labels each commit with
its weightpub version, and vLLM labels weights loaded from disk ``"default"``). The
worker RPC ``weight_request_versions()`` gives ``[first, last]`` per request id.

This module turns either into a ``VersionRange`` (the oldest and the newest version
a sample used) and lets a learner keep the samples whose oldest version is at most
``max_staleness`` versions behind its own. Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "INITIAL_LABEL",
    "VersionRange",
    "keep_fresh",
    "parse_version_label",
    "request_version_range",
    "version_range",
]

#: vLLM's label for weights it loaded itself (before any commit).
INITIAL_LABEL = "default"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class VersionRange:
    """The oldest and newest weight version that sampled a request's tokens."""

    oldest: int
    newest: int

    def __post_init__(self) -> None:
        if not 0 <= self.oldest <= self.newest:
            raise ValueError(f"version range [{self.oldest}, {self.newest}] is not "
                             "0 <= oldest <= newest")

    @property
    def mixed(self) -> bool:
        """True when a commit landed while the request was generating."""
        return self.oldest != self.newest

    def staleness(self, current_version: int) -> int:
        """How many versions the oldest token's policy is behind ``current_version``."""
        return current_version - self.oldest


def parse_version_label(label: object, *, initial_version: int = 0) -> int:
    """A version label as an int: ``"default"`` / ``None`` (no commit yet) -> ``initial_version``.

    Accepts what vLLM and the worker RPCs carry: an int, a decimal string, vLLM's
    ``"default"``, or ``None``. Anything else (a label a user set through vLLM's own
    ``update_weight_version``, say) is not a weightpub version: ``ValueError`` names it.
    """
    if label is None or label == INITIAL_LABEL:
        return initial_version
    if isinstance(label, bool):
        raise ValueError(f"weight version label {label!r} is not a weightpub version")
    if isinstance(label, int):
        number = label
    elif isinstance(label, str) and label.isascii() and label.isdigit() and len(label) <= 19:
        number = int(label)
    else:
        raise ValueError(f"weight version label {label!r} is not a weightpub version "
                         f"(expected a non-negative integer or {INITIAL_LABEL!r})")
    if number < 0:
        raise ValueError(f"weight version label {label!r} is negative")
    return number


def _span_fields(span: Any) -> tuple[object, int, int]:
    """(label, start, end) of a vLLM ``WeightVersionSpan`` or a ``(label, start, end)`` tuple."""
    if isinstance(span, Sequence) and not isinstance(span, str):
        if len(span) != 3:
            raise ValueError(f"weight version span {span!r}: expected (version, start, end)")
        label, start, end = span
    else:
        try:
            label, start, end = span.version, span.start, span.end
        except AttributeError as exc:
            raise ValueError(f"weight version span {span!r}: no version/start/end") from exc
    if not isinstance(start, int) or not isinstance(end, int):
        raise ValueError(f"weight version span {span!r}: start and end must be ints")
    return label, start, end


def version_range(spans: Iterable[Any] | None, *, initial_version: int = 0) -> VersionRange:
    """Oldest and newest version of a completion's ``weight_versions`` spans.

    Spans that cover no token (``start == end``) did not sample anything and are
    ignored unless nothing else is there. ``None`` or no spans (vLLM reports
    ``None`` when it got tokens without a label) raises ``ValueError``: such a
    sample cannot be attributed to a policy.
    """
    fields = [_span_fields(s) for s in spans or ()]
    if not fields:
        raise ValueError("no weight version spans: the request produced no tokens or the "
                         "engine did not label them (is the weightpub engine plugin active?)")
    used = [f for f in fields if f[2] > f[1]] or fields
    versions = [parse_version_label(label, initial_version=initial_version)
                for label, _, _ in used]
    return VersionRange(min(versions), max(versions))


def request_version_range(first_last: Sequence[object], *,
                          initial_version: int = 0) -> VersionRange:
    """``VersionRange`` of one ``weight_request_versions()`` entry, ``[first, last]``.

    ``None`` (the request ran before this rank committed anything) counts as
    ``initial_version``. Versions only grow within a publisher instance, so
    ``first`` is the oldest.
    """
    if isinstance(first_last, str) or len(first_last) != 2:
        raise ValueError(f"request versions {first_last!r}: expected [first, last]")
    first, last = (parse_version_label(v, initial_version=initial_version) for v in first_last)
    return VersionRange(min(first, last), max(first, last))


def _default_versions(item: Any) -> VersionRange:
    if isinstance(item, VersionRange):
        return item
    versions = getattr(item, "versions", None)
    if not isinstance(versions, VersionRange):
        raise TypeError(f"{type(item).__name__} has no 'versions' VersionRange; pass versions=")
    return versions


def keep_fresh(items: Iterable[T], current_version: int, max_staleness: int, *,
               versions: Callable[[T], VersionRange] = _default_versions,
               ) -> tuple[list[T], list[T]]:
    """Split ``items`` into (kept, dropped) by the staleness of their oldest version.

    An item is kept when ``current_version - oldest <= max_staleness`` (0: strictly
    on-policy, only samples fully generated by ``current_version``). An item whose
    newest version is above ``current_version`` cannot come from this learner's
    policy history (another run's publisher, say) and is dropped too. ``versions``
    maps an item to its ``VersionRange`` (default: the item itself, or its
    ``.versions`` attribute). Order is preserved in both lists.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness: {max_staleness} must be >= 0")
    if current_version < 0:
        raise ValueError(f"current_version: {current_version} must be >= 0")
    kept: list[T] = []
    dropped: list[T] = []
    for item in items:
        span = versions(item)
        fresh = span.newest <= current_version and span.staleness(current_version) <= max_staleness
        (kept if fresh else dropped).append(item)
    return kept, dropped
