"""The NIXL data path end to end (issue 31): a publisher process with ``nixl=True``, a
subscriber here, real NIXL agents on both sides (UCX confined to loopback).

What must hold: versions come bit-exact with every byte READ one-sided (the
publisher sends no chunk frame) and ``data_path`` says "nixl"; whatever stops the
path (this subscriber's option off, NIXL missing on either side, an offer that lies,
a corrupted region) costs ZeroMQ frames with the cause counted, never a wrong or
partial version; a publisher killed -9 mid-read stages nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import nixl_source
from tests.transport.data_path_cases import (
    CHUNK,
    SPEC,
    child_stats,
    exact,
    publish,
    start_publisher,
    subscriber,
)
from tests.transport.procs import Child, det_weights, spec_bytes, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("nixl_loopback")]

def test_three_versions_over_nixl_bit_exact(spawn: Callable[..., Child],
                                            closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, nixl=True)
    sub = subscriber(closing, endpoint)
    for version in (1, 2, 3):
        publish(pub, version)
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.version == version and exact(staged, version)
        assert staged.data_path == "nixl"
        staged.release()
    status = sub.status()
    nixl = status["nixl"]
    assert nixl["mode"] == "auto" and nixl["available"] is True
    assert nixl["fallbacks"] == 0, nixl
    total = spec_bytes(SPEC)
    assert nixl["bytes_read"] >= 3 * total
    assert 0 < nixl["registered_bytes"] <= 2 * (total + 4096)  # staging reused, not per version
    assert status["data_path"] is None or status["data_path"] == "nixl"
    stats = child_stats(pub)
    assert stats["stats"]["bytes_sent_full"] == 0  # not one chunk frame: every byte one-sided
    assert stats["stats"]["nixl_offers"] == 3
    # one snapshot buffer (keep_versions 1), registered once and reused for each version
    assert 0 < stats["nixl"]["registered_bytes"] < 2 * total
    assert stats["nixl"]["on"] is True


def test_a_subscriber_with_nixl_off_counts_it_and_fetches_frames(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, nixl=True)
    sub = subscriber(closing, endpoint, nixl=False)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    nixl = sub.status()["nixl"]
    assert nixl["mode"] == "off" and nixl["fallback_causes"].get("off", 0) >= 1
    assert nixl["registered_bytes"] == 0 and nixl["bytes_read"] == 0
    assert child_stats(pub)["stats"]["bytes_sent_full"] >= spec_bytes(SPEC)


@pytest.mark.parametrize(("fault", "named"), [("lie", "someone-else"),
                                               ("short", "do not hold")])
def test_an_offer_that_lies_or_does_not_fit_is_refused(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], fault: str,
        named: str) -> None:
    pub, endpoint = start_publisher(spawn, nixl=True, nixl_fault=fault)
    sub = subscriber(closing, endpoint)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    nixl = sub.status()["nixl"]
    assert nixl["fallback_causes"] == {"bad_offer": 1}, nixl
    assert named in nixl["last_error"]


def test_a_corrupted_region_is_refused_and_refetched_over_frames(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, nixl=True, nixl_fault="corrupt:2")
    # READs get longer than the usual 3 s: on a loaded box a slow READ falls back as
    # "timeout" (counted, correct) and hides the checksum fallback this test is about
    sub = subscriber(closing, endpoint, request_timeout=20.0)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1)  # the bad chunk never staged
    assert staged.data_path == "nixl+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["nixl"]["fallback_causes"] == {"checksum": 1}
    assert child_stats(pub)["stats"]["bytes_sent_full"] == CHUNK  # that chunk alone, as a frame


@pytest.mark.parametrize("answer", [True, False])
def test_a_corrupt_chunk_is_judged_by_claims_words_or_given_up_as_unanswered(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        paced_reads: Callable[[int], list[float]], stalled_words: Callable[[], list[Any]],
        monkeypatch: pytest.MonkeyPatch, answer: bool) -> None:
    """Chunk 2 fails its checksum; the holder's claims words (READ then) show no newer
    version, so it counts as ``checksum`` and comes as a frame. When that READ is never
    answered, the chunk still comes as a frame at once and the holder's other READs go
    on; past the bound (0.5 s here; READs are seen done one per 0.3 s, so the version is
    still in flight) the holder is given up as ``unanswered`` and frames serve the rest.
    Either way the version is staged bit-exact."""
    paced_reads(CHUNK)
    stalled = [] if answer else stalled_words()
    monkeypatch.setattr(nixl_source, "CLAIMS_TIMEOUT_S", 0.5)
    pub, endpoint = start_publisher(spawn, nixl=True, nixl_fault="corrupt+claims:2")
    sub = subscriber(closing, endpoint, request_timeout=20.0)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    nixl = sub.status()["nixl"]
    assert exact(staged, 1) and staged.data_path == "nixl+zmq", nixl
    if answer:
        assert nixl["fallback_causes"] == {"checksum": 1}, nixl
        return
    assert len(stalled) == 1 and nixl["fallback_causes"] == {"checksum": 1, "unanswered": 1}
    assert "claims words was not done after 0.5 s" in nixl["last_error"], nixl


def test_nixl_missing_on_either_side_costs_frames_not_a_crash(
        monkeypatch: pytest.MonkeyPatch, closing: Callable[[Any], Any],
        caplog: pytest.LogCaptureFixture) -> None:
    from publisher.store import nixl_export

    weights = det_weights(7, 1, SPEC)
    monkeypatch.setattr(nixl_export, "nixl_error", lambda: "NIXL is not available (test)")
    with caplog.at_level(logging.WARNING, logger="weightpub.publisher"):
        pub = closing(WeightPublisher("tcp://127.0.0.1:0", nixl=True, chunk_size=CHUNK))
    assert "nixl: off for this publisher" in caplog.text and "(test)" in caplog.text
    assert pub.data_stats()["nixl_off"] == 1
    sub = subscriber(closing, pub.endpoint)
    pub.publish(weights, version=1)
    staged = sub.wait_for_version(1, timeout=60)
    assert pub.manifest(1).nixl is None and staged.data_path == "zmq" and exact(staged, 1)
    assert sub.status()["nixl"]["fallbacks"] == 0  # nothing was offered
    monkeypatch.undo()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")

    offering = closing(WeightPublisher("tcp://127.0.0.1:0", nixl=True, chunk_size=CHUNK))
    monkeypatch.setattr(nixl_source, "nixl_error", lambda: "NIXL is not available (test)")
    without = subscriber(closing, offering.endpoint)
    offering.publish(weights, version=1)
    staged = without.wait_for_version(1, timeout=60)
    assert offering.manifest(1).nixl is not None
    assert staged.data_path == "zmq" and exact(staged, 1)
    nixl = without.status()["nixl"]
    assert nixl["available"] is False and nixl["fallback_causes"] == {"missing": 1}


def test_a_publisher_killed_mid_read_never_stages_a_partial_version(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        paced_reads: Callable[[int], list[float]]) -> None:
    paced = paced_reads(CHUNK)  # one chunk per READ, seen done one per 0.3 s
    pub, endpoint = start_publisher(spawn, nixl=True)
    sub = closing(WeightSubscriber(endpoint, request_timeout=2.0, max_chunk_retries=1,
                                   window_bytes=2 * CHUNK))
    pub.send(cmd="publish", id="1", version=1, spec=[("big", "uint8", [32 * CHUNK])])
    wait_until(lambda: len(paced) >= 1, 60, "a first chunk read one-sided")
    pub.kill9()
    fraction = sub.status()["fetching_fraction"]
    assert fraction is not None and fraction < 1.0  # killed mid-version
    wait_until(lambda: sub.status()["nixl"]["fallbacks"] >= 1
               or sub.status()["fetching_version"] is None, 60,
               "the dead holder noticed (a READ failed, timed out, or the version given up)")
    time.sleep(3)  # any late READ, and the ZeroMQ fallback to a dead publisher, play out
    assert sub.latest() is None  # nothing partial was ever staged
    status = sub.status()
    assert status["staged_version"] == 0, status
    assert set(status["nixl"]["fallback_causes"]) <= {"transfer", "unreachable", "timeout"}
    assert torch.get_num_threads() >= 1  # the process is alive and well


def test_under_curve_only_an_admitted_subscriber_gets_the_offer(
        tmp_path: Any, closing: Callable[[Any], Any]) -> None:
    """The offer names registered memory: it rides only on the authenticated PUB/ROUTER,
    so a subscriber whose key is not admitted never learns it (nor any byte)."""
    from weightpub_wire.errors import WeightPubTimeout
    from weightpub_wire.keys import create_key_pair

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = create_key_pair(tmp_path, "server")
    _, client_secret = create_key_pair(allowed, "client")
    _, stranger_secret = create_key_pair(tmp_path, "stranger")
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", nixl=True, chunk_size=CHUNK,
                                  curve_secret_key_file=str(server_secret),
                                  curve_allowed_clients_dir=str(allowed)))
    member = subscriber(closing, pub.endpoint, curve_server_key_file=str(server_public),
                         curve_secret_key_file=str(client_secret))
    stranger = subscriber(closing, pub.endpoint, curve_server_key_file=str(server_public),
                           curve_secret_key_file=str(stranger_secret))
    pub.publish(det_weights(7, 1, SPEC), version=1)
    staged = member.wait_for_version(1, timeout=60)
    assert staged.data_path == "nixl" and exact(staged, 1)
    with pytest.raises(WeightPubTimeout):
        stranger.wait_for_version(1, timeout=3)
    nixl = stranger.status()["nixl"]
    assert nixl["available"] is None and nixl["bytes_read"] == 0  # never saw an offer
    assert pub.data_stats()["bytes_sent_full"] == 0


def test_read_pace_looks_when_a_read_is_due_then_backs_off() -> None:
    """The READs in flight are looked at when their bytes should be in at the measured
    rate (not every 0.5 ms), then with a doubling wait; a measured rate carries over."""
    rate = [1e9]
    pace = nixl_source.ReadPace(rate)
    pace.posted(1, 100_000_000, now=0.0)  # 0.1 s at 1 GB/s, aimed a little early
    pace.posted(2, 100_000_000, now=0.0)  # behind the first
    first = pace.wait(0.0)
    assert 0.05 <= first <= 0.1
    late = [pace.wait(0.2) for _ in range(12)]  # past due: doubling up to the cap
    assert late[0] == nixl_source.ReadPace.MIN_S and late[1] == 2 * late[0]
    assert max(late) == late[-1] == nixl_source.ReadPace.MAX_S
    pace.done(1, 100_000_000)
    pace.measure(0.5)  # 100 MB in 0.5 s: the rate moves towards 0.2 GB/s
    assert 0.2e9 < rate[0] < 1e9
    assert pace.wait(0.5) == nixl_source.ReadPace.MIN_S  # READ 2 was due at 0.16 s
    pace.dropped(2)
    pace.idle()
    pace.posted(3, 10_000_000, now=1.0)
    assert pace.wait(1.0) > nixl_source.ReadPace.MIN_S  # the slower rate, from READ 3's post


def test_a_read_deadline_scales_with_the_bytes_in_flight_within_bounds() -> None:
    """A READ may take ``SLACK`` times what the bytes posted up to it take at the measured
    rate: never less than the floor (``request_timeout``), never more than the cap; a
    slower measured rate (a loaded box) gives the same bytes longer."""
    rate = [1e9]
    pace = nixl_source.ReadPace(rate)
    floor = 3.0
    assert pace.deadline(16 << 20, floor) == floor  # 17 ms of bytes: the floor
    big = pace.deadline(2 << 30, floor)  # 2.1 s at 1 GB/s
    assert big == pytest.approx(pace.SLACK * (2 << 30) / 1e9) and big > floor
    assert pace.deadline(1 << 40, floor) == pace.DEADLINE_MAX_S  # bounded above
    assert pace.deadline(1 << 40, 100.0) == 100.0  # a floor above the cap wins
    rate[0] = 0.1e9  # measured ten times slower
    assert pace.deadline(256 << 20, floor) == pytest.approx(pace.SLACK * (256 << 20) / 0.1e9)


def test_a_version_staged_over_nixl_is_offered_from_the_subscriber_s_own_agent(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    """Peers over NIXL (``docs/peers-over-nixl.md``, ``NixlPicker.peer_offer``): a member's
    staging, registered when its version came over NIXL, is offered from the member's own
    agent with nothing registered for its bytes (only its claims word), and another
    agent READs the staged version from there bit for
    bit (through the offer's wire form, as a peer would get it)."""
    import threading

    from weightpub_wire.nixl_link import NixlReader, decode_offer, encode_offer

    pub, endpoint = start_publisher(spawn, nixl=True)
    sub = subscriber(closing, endpoint, nixl=True)  # True: it offers peers what it staged
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert staged.data_path == "nixl" and exact(staged, 1)
    registered = sub.status()["nixl"]["registered_bytes"]
    offers: list[Any] = []
    made = threading.Event()

    def offer_it(client: Any) -> None:  # on the subscriber's thread: the agent's own
        offers.append(sub._nixl.peer_offer(staged.buffer, staged.manifest, None))
        made.set()

    sub._call(offer_it)
    assert made.wait(30)
    offer, why = offers[0]
    assert offer is not None and [r.length for r in offer.regions] == [staged.total_bytes], why
    # nothing registered for the bytes: only the buffer's claims word (8 B), offered with
    # them so a peer reading a reused buffer tells ``reused`` from corrupt
    assert offer.claims is not None and offer.claims.length == 8
    assert sub.status()["nixl"]["registered_bytes"] == registered + 8
    peer = NixlReader("test-peer")
    try:
        into = torch.zeros(staged.total_bytes, dtype=torch.uint8)
        peer.register(into.data_ptr(), into.numel())
        assert peer.read(decode_offer(encode_offer(offer)),
                         [(0, 0, into.data_ptr(), into.numel())], timeout=30) == into.numel()
        assert torch.equal(into, staged.buffer[:staged.total_bytes])
    finally:
        peer.close()
