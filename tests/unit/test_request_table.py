"""The request table, the version back-off and the fetch credit alone.

``RequestTable`` and ``VersionBackoff`` are fed times by the test (no sleeping);
``FetchCredit`` runs over a real ``Assembly`` (a 16 KiB buffer) with the publisher as
its one chunk source (a ``send`` that records each request), and a ``give_up`` that
records each abandoned version.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from subscriber_ext.transport.client.fetch_credit import FetchCredit
from subscriber_ext.transport.client.publisher_source import PublisherSource
from subscriber_ext.transport.client.source_choice import SourceChoice
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.chunk_source import SourceSink
from subscriber_ext.transport.staging.request_table import (
    QUEUED_TIMEOUT_FACTOR,
    RequestTable,
    VersionBackoff,
)
from tests.unit.transport_fakes import CHUNK, OLD, manifest
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ChecksumError, WeightPubError, WeightPubTimeout

pytestmark = pytest.mark.timeout(10)

PEER = object()  # a peer link, as the table sees it: any object


# -- RequestTable ---------------------------------------------------------------------------------
def test_ids_are_fresh_and_requests_are_tracked_by_id() -> None:
    table = RequestTable()
    first, second = table.next_id(), table.next_id()
    assert second > first
    table.track(first, [1, 2], 0.0)
    table.track(second, (3,), 0.0, PEER)
    assert first in table and table.get(first) is not None
    assert table.asked() == {1, 2, 3}
    assert table.in_flight() == 2  # the publisher's credit counts its own requests only
    assert table.peer_in_flight() == {PEER: 1}
    table.forget(first)
    assert first not in table and table.asked() == {3}


def test_a_request_ends_when_its_last_chunk_is_done() -> None:
    table = RequestTable()
    table.track(1, [4, 5], 0.0)
    request = table.get(1)
    assert request is not None
    table.chunk_done(1, request, 4)
    assert 1 in table and table.asked() == {5}
    table.chunk_done(1, request, 5)
    assert 1 not in table and table.in_flight() == 0


def test_only_the_publishers_answers_count_as_the_publisher_answering() -> None:
    table = RequestTable()
    table.track(1, [0], 0.0, PEER)
    peer_request = table.get(1)
    assert peer_request is not None
    table.chunk_done(1, peer_request, 0)
    assert table.publisher_answered == 0.0
    table.track(2, [1], 0.0)
    request = table.get(2)
    assert request is not None
    before = time.monotonic()
    table.chunk_done(2, request, 1)
    assert table.publisher_answered >= before


def test_tries_are_counted_per_chunk_until_a_new_target() -> None:
    table = RequestTable()
    assert [table.count_try(7) for _ in range(3)] == [1, 2, 3]
    assert table.count_try(8) == 1
    table.track(1, [7], 0.0)
    table.clear()
    assert table.count_try(7) == 1 and 1 not in table


def test_dropping_a_peer_forgets_only_what_it_was_asked() -> None:
    table = RequestTable()
    other = object()
    table.track(1, [0], 0.0, PEER)
    table.track(2, [1], 0.0, other)
    table.track(3, [2], 0.0)
    assert table.peer_requests(PEER) == {1}
    table.drop(PEER)
    assert 1 not in table and 2 in table and 3 in table


def test_an_unanswered_publisher_request_times_out_once() -> None:
    table = RequestTable()
    table.track(1, [0, 1], 100.0)
    table.track(2, [2], 100.0, PEER)  # peers' requests: peering.py decides
    assert list(table.timed_out(104.9, 5.0)) == []
    expired = list(table.timed_out(105.0, 5.0))
    assert [r.chunks for r in expired] == [{0, 1}]
    assert 1 not in table and 2 in table
    assert list(table.timed_out(200.0, 5.0)) == []


def test_a_queued_request_waits_while_the_publisher_keeps_answering() -> None:
    table = RequestTable()
    timeout = 1.0
    sent = time.monotonic() - 5 * timeout  # asked five timeouts ago, behind a full window
    table.track(1, [0], sent)
    table.track(2, [1], sent)
    first = table.get(1)
    assert first is not None
    table.chunk_done(1, first, 0)  # the publisher answers just now: request 2 is queued
    answered = table.publisher_answered
    assert list(table.timed_out(answered + 0.5 * timeout, timeout)) == []
    assert list(table.timed_out(answered + timeout, timeout)) != []  # then silence: asked again
    table.track(2, [1], sent)
    late = sent + QUEUED_TIMEOUT_FACTOR * timeout
    table.publisher_answered = late  # answering others all along: the bound still holds
    assert [r.chunks for r in table.timed_out(late, timeout)] == [{1}]


# -- VersionBackoff -------------------------------------------------------------------------------
def test_a_version_given_up_waits_one_two_four_seconds_then_at_most_thirty() -> None:
    backoff = VersionBackoff()
    waits = []
    for _ in range(8):
        backoff.record(OLD, 5, 1000.0)
        wait = 0.0
        while backoff.waiting(OLD, 5, 1000.0 + wait):
            wait += 0.5
        waits.append(wait)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_the_back_off_is_per_version_and_forgotten_once_staged() -> None:
    backoff = VersionBackoff()
    backoff.record(OLD, 5, 10.0)
    assert backoff.waiting(OLD, 5, 10.5)
    assert not backoff.waiting(OLD, 6, 10.5) and not backoff.waiting("c" * 32, 5, 10.5)
    backoff.forget(OLD, 5)
    assert not backoff.waiting(OLD, 5, 10.5)
    backoff.record(OLD, 5, 10.0)  # the count starts again: one second
    assert not backoff.waiting(OLD, 5, 11.0)


# -- FetchCredit ----------------------------------------------------------------------------------
def _unused(*args: object) -> None:
    raise AssertionError("no replies in these tests")


class Credit:
    """A ``FetchCredit`` over one real target, recording what it sends and gives up."""

    def __init__(self, *, chunks: int = 8, window_chunks: int = 3, per_request: int = 2,
                 retries: int = 2) -> None:
        self.pool = BufferPool(pinned=False)
        self.target: Assembly | None = Assembly(manifest(4, chunks=chunks), self.pool)
        self.sent: list[wire.FetchRequest] = []
        self.given_up: list[WeightPubError] = []
        self.connected = True
        self.requests = RequestTable()
        publisher = PublisherSource(self.requests, self._send, chunks_per_request=per_request,
                                    request_timeout=5.0)
        sink = SourceSink(self.requests, chunk=_unused, error=_unused, bad=_unused,
                          discard_rest=_unused)
        self.credit = FetchCredit(self.requests, SourceChoice([], publisher, sink),
                                  target=lambda: self.target, give_up=self.given_up.append,
                                  window_bytes=window_chunks * CHUNK, max_chunk_retries=retries)

    def _send(self, message: wire.Message) -> bool:
        if not self.connected:
            return False
        assert isinstance(message, wire.FetchRequest)
        self.sent.append(message)
        return True

    def close(self) -> None:
        if self.target is not None:
            self.target.abandon()


@pytest.fixture
def rig() -> Iterator[Credit]:
    credit = Credit()
    yield credit
    credit.close()


def test_credit_fills_the_window_in_batches(rig: Credit) -> None:
    rig.credit.top_up(0.0)
    assert [len(r.chunks) for r in rig.sent] == [2, 1]  # window of 3, 2 per request
    assert all(r.version == 4 and r.publisher_id == OLD for r in rig.sent)
    assert rig.requests.in_flight() == 3
    rig.credit.top_up(0.0)
    assert len(rig.sent) == 2  # no credit left: nothing more asked


def test_credit_refills_in_whole_requests_not_one_per_landed_chunk() -> None:
    """With chunks in flight, a request's worth of room must be free before more is asked:
    one chunk landing asks nothing, the second asks both in one request."""
    rig = Credit(chunks=16, window_chunks=6, per_request=2)
    try:
        rig.credit.top_up(0.0)
        assert [len(r.chunks) for r in rig.sent] == [2, 2, 2]
        first = rig.sent[0]
        request = rig.requests.get(first.req)
        assert request is not None
        rig.requests.chunk_done(first.req, request, first.chunks[0])
        rig.credit.top_up(0.0)
        assert len(rig.sent) == 3  # one chunk of room: not a request's worth yet
        rig.requests.chunk_done(first.req, request, first.chunks[1])
        rig.credit.top_up(0.0)
        assert [len(r.chunks) for r in rig.sent] == [2, 2, 2, 2]
        assert rig.requests.in_flight() == 6
    finally:
        rig.close()


def test_no_target_no_credit(rig: Credit) -> None:
    rig.close()
    rig.target = None
    assert rig.credit.credit() == 0
    rig.credit.top_up(0.0)
    assert rig.sent == []


def test_a_request_that_cannot_be_sent_is_not_tracked(rig: Credit) -> None:
    rig.connected = False
    rig.credit.top_up(0.0)
    assert rig.sent == [] and rig.requests.in_flight() == 0


def test_timed_out_chunks_are_asked_again_until_too_many_tries(rig: Credit) -> None:
    rig.credit.top_up(0.0)
    asked = set().union(*(r.chunks for r in rig.sent))
    for round_ in range(2):  # max_chunk_retries = 2: two timeouts are retried
        now = 10.0 * (round_ + 1)
        rig.credit.expire(now)
        assert rig.given_up == [] and rig.requests.in_flight() == 0
        rig.credit.top_up(now)
        assert set().union(*(r.chunks for r in rig.sent[-2:])) == asked
    rig.credit.expire(30.0)
    assert len(rig.given_up) == 1  # the third timeout gives the version up
    error = rig.given_up[0]
    assert isinstance(error, WeightPubTimeout)
    assert "of version 4 timed out 3 times" in str(error)


def test_a_failed_chunk_counts_as_a_try(rig: Credit) -> None:
    assert not rig.credit.count_retry(5, "failed its checksum", ChecksumError)
    assert not rig.credit.count_retry(5, "failed its checksum", ChecksumError)
    assert rig.credit.count_retry(5, "failed its checksum", ChecksumError)
    assert [type(e) for e in rig.given_up] == [ChecksumError]
    assert str(rig.given_up[0]) == "chunk 5 of version 4 failed its checksum 3 times"
