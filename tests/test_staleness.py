"""Staleness helpers: version spans -> (oldest, newest), and the learner's filter."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from subscriber_ext import VersionRange, keep_fresh, request_version_range, version_range
from subscriber_ext.staleness import parse_version_label


@dataclass
class Span:
    """Same fields as ``vllm.outputs.WeightVersionSpan`` (version is a string there)."""

    version: str
    start: int
    end: int


@dataclass
class Rollout:
    name: str
    versions: VersionRange


def test_spans_give_oldest_and_newest_version() -> None:
    spans = [Span("3", 0, 2), Span("4", 2, 5), Span("6", 5, 6)]
    got = version_range(spans)
    assert got == VersionRange(3, 6)
    assert got.mixed
    assert got.staleness(7) == 4
    assert not version_range([Span("5", 0, 4)]).mixed


def test_disk_weights_label_and_none_count_as_the_initial_version() -> None:
    assert version_range([Span("default", 0, 3), Span("1", 3, 4)]) == VersionRange(0, 1)
    assert version_range([("default", 0, 2)], initial_version=10) == VersionRange(10, 10)
    assert request_version_range([None, 2]) == VersionRange(0, 2)
    assert request_version_range([4, 4]) == VersionRange(4, 4)


def test_spans_without_tokens_do_not_count() -> None:
    # a commit noted before the request's next token, then a newer one that sampled it all
    assert version_range([("2", 0, 0), ("3", 0, 4)]) == VersionRange(3, 3)
    assert version_range([("2", 0, 0)]) == VersionRange(2, 2)


@pytest.mark.parametrize("bad", [None, [], [("x1", 0, 2)], [("-1", 0, 1)], [("1", 0)],
                                 [object()], [("1", "0", 2)], [(True, 0, 1)]])
def test_unattributable_spans_raise_value_error(bad) -> None:
    with pytest.raises(ValueError):
        version_range(bad)


def test_labels() -> None:
    assert parse_version_label("17") == 17
    assert parse_version_label(17) == 17
    assert parse_version_label("default", initial_version=5) == 5
    for bad in ("v2", "", "1.5", "²", -3, 2.0, "9" * 30):
        with pytest.raises(ValueError):
            parse_version_label(bad)
    with pytest.raises(ValueError):
        VersionRange(3, 2)
    with pytest.raises(ValueError):
        request_version_range([1])


def test_keep_fresh_drops_what_is_too_old_and_keeps_order() -> None:
    rollouts = [Rollout("on-policy", VersionRange(10, 10)),
                Rollout("one behind", VersionRange(9, 10)),
                Rollout("two behind", VersionRange(8, 8)),
                Rollout("three behind", VersionRange(7, 9)),
                Rollout("from the future", VersionRange(11, 11)),
                Rollout("also on-policy", VersionRange(10, 10))]
    kept, dropped = keep_fresh(rollouts, current_version=10, max_staleness=2)
    assert [r.name for r in kept] == ["on-policy", "one behind", "two behind", "also on-policy"]
    assert [r.name for r in dropped] == ["three behind", "from the future"]
    kept, dropped = keep_fresh(rollouts, 10, 0)
    assert [r.name for r in kept] == ["on-policy", "also on-policy"]
    assert len(dropped) == 4


def test_keep_fresh_takes_ranges_or_a_key() -> None:
    kept, dropped = keep_fresh([VersionRange(0, 0), VersionRange(3, 3)], 3, 1)
    assert kept == [VersionRange(3, 3)] and dropped == [VersionRange(0, 0)]
    pairs = {"a": [None, 1], "b": [2, 2]}  # weight_request_versions() output
    kept_ids, dropped_ids = keep_fresh(pairs, 2, 0,
                                       versions=lambda k: request_version_range(pairs[k]))
    assert kept_ids == ["b"] and dropped_ids == ["a"]
    with pytest.raises(TypeError):
        keep_fresh([object()], 1, 1)
    with pytest.raises(ValueError):
        keep_fresh([], 1, -1)
