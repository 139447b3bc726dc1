"""Counts by key over a bounded set of keys.

Why: fallback causes, failure reasons and ranks are counted per key in status dicts and
metric labels; some keys come from peers or faults, so the key set must not grow without
bound. One helper says how, instead of the same two lines in every counter.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["count_bounded"]

K = TypeVar("K")


def count_bounded(counts: dict[K, int], key: K, max_keys: int) -> None:
    """``counts[key] += 1``, unless ``key`` is new and ``max_keys`` keys are held already
    (then nothing: the total of the other keys stays right, the new key is not named)."""
    if key in counts or len(counts) < max_keys:
        counts[key] = counts.get(key, 0) + 1
