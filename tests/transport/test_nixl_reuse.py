"""A holder that reuses a version's buffer under a reader's READs (issue 31), real NIXL agents
in two processes (UCX confined to loopback).

With ``keep_versions`` 1 a publisher copies version 2 into the buffer version 1 is offered
from, and a one-sided reader may still be READing version 1 there: nothing tells the
holder (the reads are one-sided) and the writer never waits for readers
(``publisher/store/buffer_claims.py``). What must hold: no torn byte is staged (every chunk
READ is verified against the manifest's checksums), and the reader tells the reuse from a
corrupt region: the offer carries the buffer's claims words (``NixlClaims``), the reader
READs them for a chunk that failed its checksum, counts ``reused`` once for the version
(not ``checksum``), stops READing that buffer for it, and the version's rest is asked as
frames (which the publisher refuses where version 2 overwrote it: the subscriber moves on
to version 2, READ whole).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext.transport.client import nixl_source
from tests.transport.data_path_cases import (
    CHUNK,
    SPEC,
    exact,
    publish,
    start_publisher,
    subscriber,
)
from tests.transport.procs import Child, det_weights, wait_until
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay
from weightpub_wire.nixl_link import NixlReader, NixlTransfer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("nixl_loopback")]


def _hold_reads_after_the_first(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """READs of one chunk each; once the first is seen done, none is seen done again until
    the returned event is set (a slow link, as the reader sees it): the READs posted
    after that read what the holder's buffer holds then."""
    monkeypatch.setattr(nixl_source, "_READ_BYTES", CHUNK)
    release = threading.Event()
    seen: list[bool] = []
    poll = NixlReader.poll

    def held(self: NixlReader, transfer: NixlTransfer) -> bool:
        if seen and not release.is_set():
            return False
        done = poll(self, transfer)
        if done:
            seen.append(done)
        return done

    monkeypatch.setattr(NixlReader, "poll", held)
    return release


def test_a_buffer_reused_under_the_reads_is_counted_as_reused_and_never_staged(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = _hold_reads_after_the_first(monkeypatch)
    pub, endpoint = start_publisher(spawn, nixl=True)  # keep_versions 1: one buffer
    # one chunk in the window (two READs in flight); a newer version never replaces the
    # target (it waits queued), so version 1 is still READ after version 2 is copied
    staged_versions: list[int] = []  # every version staged, as it is
    sub = subscriber(closing, endpoint, window_bytes=CHUNK, switch_below_fraction=0.0,
                     request_timeout=10.0,
                     on_version=lambda staged: staged_versions.append(staged.version))
    publish(pub, 1)
    wait_until(lambda: sub.status()["nixl"]["bytes_read"] >= CHUNK, 60,
               "the first READ of version 1 done")
    assert sub.status()["fetching_version"] == 1
    publish(pub, 2)  # returns once version 2 is copied whole into version 1's buffer
    release.set()
    staged = sub.wait_for_version(2, timeout=60)
    assert staged.version == 2 and exact(staged, 2)  # bit-exact: nothing torn staged
    nixl = sub.status()["nixl"]
    # the torn chunks of version 1 are told apart: reused, once for the version
    assert nixl["fallback_causes"] == {"reused": 1}, nixl
    assert "overwritten by version 2" in nixl["last_error"], nixl
    assert staged.data_path == "nixl", nixl  # version 2 itself is READ whole
    assert staged_versions == [2]  # version 1 never was
    assert sub.status()["checksum_failures"] >= 1  # its torn chunks were READ and refused


def test_a_relay_reusing_its_buffer_under_the_reads_is_counted_as_reused(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same behind a cut-through relay (keep_versions 1): it copies version 2 from
    upstream chunk by chunk into the buffer version 1 is offered from downstream."""
    release = _hold_reads_after_the_first(monkeypatch)
    pub = make_pub(chunk_size=CHUNK)  # the trainer offers no NIXL: only the relay does
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint}, "cut_through": True,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "nixl": True}})))
    pub.publish(det_weights(7, 1, SPEC), version=1)
    wait_until(lambda: _offered(relay, 1), 60, "version 1 offered by the relay")
    staged_versions: list[int] = []
    sub = subscriber(closing, relay.endpoint, window_bytes=CHUNK, switch_below_fraction=0.0,
                     request_timeout=10.0,
                     on_version=lambda staged: staged_versions.append(staged.version))
    wait_until(lambda: sub.status()["nixl"]["bytes_read"] >= CHUNK, 60,
               "the first READ of version 1 done")
    pub.publish(det_weights(7, 2, SPEC), version=2)
    wait_until(lambda: _offered(relay, 2), 60, "version 2 copied whole by the relay")
    release.set()
    staged = sub.wait_for_version(2, timeout=60)
    assert staged.version == 2 and exact(staged, 2) and staged_versions == [2]
    nixl = sub.status()["nixl"]
    assert nixl["fallback_causes"] == {"reused": 1}, nixl
    assert staged.data_path == "nixl", nixl


def _offered(relay: Relay, version: int) -> bool:
    try:
        return relay.publisher.manifest(version).nixl is not None
    except Exception:  # not announced yet
        return False


def test_claims_words_that_do_not_answer_do_not_hold_the_subscriber(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch, stalled_words: Callable[[], list[Any]]) -> None:
    """As above, but the READ of the holder's claims words is never answered: the
    subscriber's loop does not wait for it (``WORDS_WAIT_S`` at most, then it is looked
    at with the transfers), so version 1's torn rest goes to frames (refused there:
    overwritten) and version 2 is READ and staged while that READ is still in flight,
    well inside its bound (``CLAIMS_TIMEOUT_S``, 60 s here; the wait in place it replaced
    held the loop that long per torn chunk). Unjudged, the torn chunks count as
    ``checksum``, never ``reused``."""
    release = _hold_reads_after_the_first(monkeypatch)
    stalled = stalled_words()
    monkeypatch.setattr(nixl_source, "CLAIMS_TIMEOUT_S", 60.0)
    pub, endpoint = start_publisher(spawn, nixl=True)  # keep_versions 1: one buffer
    sub = subscriber(closing, endpoint, window_bytes=CHUNK, switch_below_fraction=0.0,
                     request_timeout=60.0)
    publish(pub, 1)
    wait_until(lambda: sub.status()["nixl"]["bytes_read"] >= CHUNK, 60,
               "the first READ of version 1 done")
    publish(pub, 2)
    release.set()
    staged = sub.wait_for_version(2, timeout=30)
    assert stalled, "no READ of the claims words was posted"
    assert staged.version == 2 and exact(staged, 2) and staged.data_path == "nixl"
    causes = sub.status()["nixl"]["fallback_causes"]
    assert "reused" not in causes and causes.get("checksum", 0) >= 1, causes
