"""Peers over NIXL (issue 31, ``docs/peers-over-nixl.md``): a member READs a version
one-sided from the peer its plan chains it to, real processes and real NIXL agents (UCX
confined to loopback), as ``test_peers.py`` joins them (``peer_fanout=1``: slot 1
fetches from slot 0).

What must hold: the second member of a chain READs the version bit-exact from the
first (``data_path`` "nixl", the first serves no chunk frame and answers one offer); a
first member without NIXL costs frames, the cause counted on the reading side
(``peer_unoffered``) and, where its version came as frames, on the serving side
(``nixl_unoffered``); the first member killed -9 mid-read stages nothing partial at the
second; under CURVE only an admitted key gets an offer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.auth

from publisher import WeightPublisher
from publisher.publisher_metrics import PublisherCollector
from subscriber_ext import WeightSubscriber
from subscriber_ext.observe.replica_metrics import peer_nixl_counters
from subscriber_ext.observe.status_board import StatusBoard
from tests.transport.procs import Child, det_weights, digests, wait_until
from tests.transport.test_peers import SEED, join, peer_dealer, peers_status, staged_ok
from tests.unit.scrape import scrape
from weightpub_wire import protocol as wire
from weightpub_wire.keys import create_key_pair
from weightpub_wire.peer_protocol import PeerNixl, PeerNixlOffer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("nixl_loopback")]

SPEC = [("w", "float32", [512, 1024]), ("b", "int32", [70_000])]
CHUNK = 256 << 10


def _options(nixl: bool | None) -> dict[str, Any]:
    return {"options": {"request_timeout": 10.0, "report_interval": 0.3, "nixl": nixl}}


def test_the_second_member_reads_the_version_from_the_first_over_nixl(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        tmp_path: Any) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=True)
    first, second = join(spawn, pub, 2, SPEC, lambda i: _options(True))
    total = chunks = 0
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        for child in (first, second):
            staged_ok(child, version)
        assert staged_ok(second, version, timeout=1)["data_path"] == "nixl"
        total += pub.manifest(version).total_bytes
        chunks += pub.manifest(version).num_chunks
    served, read = peers_status(first), peers_status(second)
    assert read["peers"]["nixl_bytes_from_peers"] == total, read["peers"]
    assert read["peers"]["bytes_from_peers"] == 0  # no frame from the first member
    assert served["peers"]["served_chunks"] == 0, served["peers"]
    assert served["peers"]["nixl_offers"] == 2 and served["peers"]["nixl_unoffered"] == {}
    # its claims words (and readiness maps) for peers, counted in the staging budget
    assert served["nixl"]["peer_words_bytes"] >= 16, served["nixl"]
    assert served["staging_cache_bytes"] == served["nixl"]["peer_words_bytes"]
    assert read["nixl"]["fallbacks"] == 0, read["nixl"]
    assert pub.data_stats()["bytes_sent_full"] == 0  # the publisher's bytes went one-sided
    # on a replica's /metrics: each member's status file, as a worker writes it
    board = StatusBoard(tmp_path)
    for rank, status in enumerate((served, read)):
        board.write(rank, {"rank": rank, "peer_nixl": peer_nixl_counters(status)})
    text = scrape(board)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert [samples.get(f'weightpub_{name}_total{{rank="{rank}"}}') for name, rank in (
        ("peer_nixl_offers", 0), ("nixl_bytes_from_peers", 1), ("nixl_chunks_from_peers", 1),
        ("nixl_bytes_from_peers", 0), ("peer_nixl_offers", 1))] == [2, total, chunks, 0, 0]
    assert not any(key.startswith("weightpub_peer_nixl_unoffered") for key in samples)
    # in the reports the publisher aggregates: its fleet total, each member's row, /metrics
    expected = wire.PeerNixlFigures(bytes_from_peers=total, chunks_from_peers=chunks, offers=2)
    wait_until(lambda: pub.peer_nixl_totals() == expected, 20,
               "the members' reports of their peer NIXL counters")
    rows = {r.subscriber_id: r.peer_nixl for r in pub.fleet()}
    assert rows["m0"] == wire.PeerNixlFigures(offers=2), rows
    assert rows["m1"] == wire.PeerNixlFigures(bytes_from_peers=total, chunks_from_peers=chunks)
    metrics = {m.name: m.samples for m in PublisherCollector(pub._figures).collect()}
    assert metrics["weightpub_publisher_fleet_nixl_bytes_from_peers"][0].value == total
    assert metrics["weightpub_publisher_fleet_peer_nixl_offers"][0].value == 2


def test_a_chain_of_three_reads_what_the_middle_member_read_over_nixl(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child]) -> None:
    """The last member READs from the middle one, which READ it from the first: the
    middle member offers staging its own ``PeerNixlSource`` registered."""
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=True)
    members = join(spawn, pub, 3, SPEC, lambda i: _options(True))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    for child in members:
        assert staged_ok(child, 1)["data_path"] == "nixl"
    total = pub.manifest(1).total_bytes
    statuses = [peers_status(child) for child in members]
    assert [s["peers"]["nixl_bytes_from_peers"] for s in statuses] == [0, total, total]
    assert [s["peers"]["served_chunks"] for s in statuses] == [0, 0, 0]
    assert [s["peers"]["nixl_offers"] for s in statuses[:2]] == [1, 1], statuses
    assert all(s["nixl"]["fallbacks"] == 0 for s in statuses), [s["nixl"] for s in statuses]


@pytest.mark.parametrize("where", ["member", "publisher"])
def test_a_first_member_without_nixl_costs_frames_with_the_cause_counted(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        where: str, tmp_path: Any) -> None:
    """``member``: the first member runs without NIXL (``nixl=False``); ``publisher``: no
    offer from the publisher, so the first member's version came as frames."""
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=where == "member")
    first, second = join(spawn, pub, 2, SPEC,
                         lambda i: _options(where == "publisher" or i == 1))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    staged_ok(first, 1)
    assert staged_ok(second, 1)["data_path"] == "zmq"
    read = peers_status(second)
    assert read["nixl"]["fallback_causes"].get("peer_unoffered") == 1, read["nixl"]
    assert read["peers"]["bytes_from_peers"] == pub.manifest(1).total_bytes  # as frames
    assert read["peers"].get("nixl_bytes_from_peers") == 0
    served = peers_status(first)["peers"]
    if where == "publisher":  # asked, and said why not: its staging is not registered
        assert served["nixl_unoffered"] == {"frames": 1}, served
        board = StatusBoard(tmp_path)
        board.write(0, {"rank": 0, "peer_nixl": peer_nixl_counters(peers_status(first))})
        assert 'weightpub_peer_nixl_unoffered_total{cause="frames",rank="0"} 1.0' \
            in scrape(board)
        wait_until(lambda: (pub.peer_nixl_totals() or wire.PeerNixlFigures()).unoffered
                   == (("frames", 1),), 20, "the first member's report of the cause")
    else:
        assert served["nixl_unoffered"] == {} and "nixl_bytes_from_peers" not in served


def test_a_peer_that_never_answers_costs_the_wait_once(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        closing: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A first member that drops ``peer_nixl`` (one that predates it): the second holds
    its chunks for the answer once (``NIXL_WAIT_S``), counts ``peer_unoffered``, and for
    later versions asks again without holding (frames at once)."""
    from subscriber_ext.transport.peers.peer_server import PeerServer
    from subscriber_ext.transport.peers.peering import NIXL_WAIT_S

    monkeypatch.setattr(PeerServer, "_answer_nixl", lambda self, identity, request: None)
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=True)
    first = closing(WeightSubscriber(pub.endpoint, peer_share=True, nixl=True,
                                     subscriber_id="m0"))
    wait_until(lambda: first.status()["peers"]["slot"] == 0, 20, "the first slot")
    second = spawn("peer", endpoint=pub.endpoint, seed=SEED, spec=SPEC, name="m1",
                   **_options(True))
    second.event("ready", timeout=60)
    wait_until(lambda: peers_status(second)["peers"]["slot"] == 1, 20, "the second slot")
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    assert staged_ok(second, 1)["fetch_seconds"] >= NIXL_WAIT_S  # held for the answer
    assert peers_status(second)["nixl"]["fallback_causes"] == {"peer_unoffered": 1}
    total = pub.manifest(1).total_bytes
    pub.publish(det_weights(SEED, 2, SPEC), version=2)
    assert staged_ok(second, 2)["data_path"] == "zmq"
    status = peers_status(second)
    # not held: staged before its question ran out (which would count a second one)
    assert status["nixl"]["fallback_causes"] == {"peer_unoffered": 1}, status["nixl"]
    assert status["peers"]["bytes_from_peers"] == total + pub.manifest(2).total_bytes


#: the paced tests' version: 12 chunks of 1 MiB, one READ each
BIG_CHUNK = 1 << 20
BIG_SPEC = [("big", "uint8", [12 * BIG_CHUNK])]


def _big_chain(make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
               closing: Callable[[Any], Any],
               **second_options: Any) -> tuple[WeightPublisher, Child, WeightSubscriber]:
    """A publisher of ``BIG_SPEC``, a first member (a child) and a second one here, in
    one chain (``peer_fanout`` 1), the second in its slot."""
    pub = make_pub(chunk_size=BIG_CHUNK, peer_fanout=1, nixl=True)
    (first,) = join(spawn, pub, 1, BIG_SPEC, lambda i: _options(True))
    second = closing(WeightSubscriber(pub.endpoint, peer_share=True, nixl=True,
                                      request_timeout=2.0, window_bytes=2 * BIG_CHUNK,
                                      subscriber_id="m1", **second_options))
    wait_until(lambda: second.status()["peers"]["slot"] == 1, 20, "the second slot")
    return pub, first, second


def test_the_first_member_killed_mid_read_stages_nothing_partial(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        closing: Callable[[Any], Any], paced_reads: Callable[[int], list[float]]) -> None:
    pub, first, second = _big_chain(make_pub, spawn, closing)
    paced = paced_reads(BIG_CHUNK)  # one chunk per READ, seen done one per 0.3 s
    pub.publish(det_weights(SEED, 1, BIG_SPEC), version=1)
    staged_ok(first, 1)
    wait_until(lambda: len(paced) >= 2, 60, "chunks read one-sided from the first member")
    first.kill9()
    fraction = second.status()["fetching_fraction"]
    assert fraction is not None and fraction < 1.0  # killed mid-version
    wait_until(lambda: second.latest() is not None, 60, "the version, from the publisher")
    staged = second.latest()
    assert staged is not None and staged.version == 1
    assert digests(staged.items()) == digests(det_weights(SEED, 1, BIG_SPEC).items())
    # the rest came from the next source in the chain, the publisher: its own offer
    assert staged.data_path == "nixl", staged.data_path
    status, total = second.status(), pub.manifest(1).total_bytes
    assert 0 < status["peers"]["nixl_bytes_from_peers"] < total, status["peers"]
    assert status["nixl"]["bytes_read"] >= total  # every chunk one-sided
    causes = status["nixl"]["fallback_causes"]
    assert causes and set(causes) <= {"transfer", "unreachable", "timeout", "unanswered"}, causes


def test_under_curve_a_stranger_gets_no_offer(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        tmp_path: Any) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = map(str, create_key_pair(tmp_path, "server"))
    secrets = [str(create_key_pair(allowed, f"member{i}")[1]) for i in range(2)]
    stranger = str(create_key_pair(tmp_path, "stranger")[1])
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=True,
                   curve_secret_key_file=server_secret, curve_allowed_clients_dir=str(allowed))
    first, second = join(spawn, pub, 2, SPEC, lambda i: {**_options(True), "peer": {
        "curve_server_key_file": server_public, "curve_secret_key_file": secrets[i]}})
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    for child in (first, second):
        staged_ok(child, 1)
    assert staged_ok(second, 1, timeout=1)["data_path"] == "nixl"
    endpoint = peers_status(first)["peers"]["endpoint"]
    server_key, _ = zmq.auth.load_certificate(secrets[0])
    publisher_id = pub.manifest(1).publisher_id

    def ask(client_secret: str | None, wait: float) -> PeerNixlOffer | None:
        """Ask the first member for its offer of version 1 (None: no answer)."""
        with peer_dealer(endpoint, server_key, client_secret) as dealer:
            dealer.send(wire.encode(PeerNixl(req=7, publisher_id=publisher_id, version=1)))
            if not dealer.poll(int(wait * 1000)):
                return None
            return msgspec.msgpack.decode(dealer.recv(), type=PeerNixlOffer)

    answer = ask(secrets[1], 20)  # a member the tracker vouched for: an offer
    assert answer is not None and answer.req == 7 and answer.offer is not None, answer
    assert answer.offer.regions[0].length >= pub.manifest(1).total_bytes
    assert ask(stranger, 1.5) is None  # a key the publisher never saw: nothing
    assert ask(None, 1.5) is None  # no CURVE at all: nothing


def test_a_staging_buffer_reused_under_the_read_is_counted_reused(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        closing: Callable[[Any], Any], paced_reads: Callable[[int], list[float]]) -> None:
    """The first member stages versions 2 and 3 while the second still READs version 1
    from it: version 3 lands in version 1's staging buffer (a pool of two), so the
    chunks read after that fail their checksum, and the buffer's claims word (version
    3, stored before its first byte landed) tells ``reused`` from corrupt."""
    pub, first, second = _big_chain(make_pub, spawn, closing, switch_below_fraction=0.0)
    paced = paced_reads(BIG_CHUNK)  # one chunk per READ, seen done one per 0.3 s
    pub.publish(det_weights(SEED, 1, BIG_SPEC), version=1)
    staged_ok(first, 1)
    wait_until(lambda: len(paced) >= 1, 60, "a chunk read one-sided from the first member")
    for version in (2, 3):
        pub.publish(det_weights(SEED, version, BIG_SPEC), version=version)
        staged_ok(first, version)
    wait_until(lambda: second.status()["nixl"]["fallback_causes"].get("reused", 0) >= 1, 60,
               "a chunk of version 1 overwritten by version 3 at the first member")
    causes = second.status()["nixl"]["fallback_causes"]
    assert causes["reused"] == 1 and "checksum" not in causes, causes  # counted once
    wait_until(lambda: second.status()["staged_version"] == 3, 60, "version 3")
    staged = second.latest()
    assert staged is not None and staged.version == 3  # version 1 was given up, not torn
    assert digests(staged.items()) == digests(det_weights(SEED, 3, BIG_SPEC).items())


def test_the_words_kept_for_peers_count_in_the_staging_budget(
        make_pub: Callable[..., WeightPublisher]) -> None:
    """A member's claims word and readiness map of a staging buffer (8 B a word) are
    counted in its staging budget while they live, released with the buffer; with no
    room for a readiness map a version still arriving is not offered (``budget``)."""
    from subscriber_ext.transport.client.nixl_source import NixlPicker
    from weightpub_wire.buffers import BufferPool

    pub = make_pub(chunk_size=CHUNK)
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    pub.wait_announced(1)
    manifest = pub.manifest(1)
    size, words = manifest.total_bytes, 8 * (manifest.num_chunks + 1)
    picker = NixlPicker(True, request_timeout=5.0, window_bytes=1 << 20)
    try:
        assert picker.wait_started(30), picker.status()
        pool = BufferPool(allocator=picker.allocator(None), budget_bytes=size + words)
        picker.words.pool = pool
        buffer = pool.take(size)
        picker.register(buffer)
        offer, why = picker.peer_offer(buffer, manifest, lambda chunk: chunk == 0)
        assert offer is not None and offer.ready is not None and offer.claims is not None, why
        status = picker.status()
        assert pool.side_bytes == words == status["peer_words_bytes"], status
        assert pool.held_bytes == size + words
        assert status["registered_bytes"] == size + words  # the words are registered too
        pool.give(buffer)
        assert not pool.room_for(size + 1)  # the idle buffer is dropped: its words go
        status = picker.status()
        assert pool.side_bytes == 0 == status["peer_words_bytes"] == status["registered_bytes"]
        pool.budget_bytes = size  # a full budget: no room for a word
        buffer = pool.take(size)
        picker.register(buffer)
        assert picker.peer_offer(buffer, manifest, lambda chunk: chunk == 0) == \
            (None, "budget (no room in the staging budget for its readiness map)")
        offer, _ = picker.peer_offer(buffer, manifest, None)  # staged: no map needed
        assert offer is not None and offer.claims is None and pool.side_bytes == 0
        assert picker.status()["peer_words_refused"] == 2
    finally:
        picker.close()


def test_a_bad_peer_nixl_offer_is_refused_naming_the_field() -> None:
    """A peer's answer is decoded with the offer's bounds (regions, metadata, names)
    before anything is built: a bad one is a ``ProtocolError`` naming the field."""
    from weightpub_wire.errors import ProtocolError
    from weightpub_wire.nixl_link import NixlOffer, NixlRegion
    from weightpub_wire.peer_protocol import PEER_NIXL_REPLIES

    good = NixlOffer("agent", b"meta", [NixlRegion(4096, 1 << 20)])
    reply = PeerNixlOffer(req=3, version=2, offer=good)
    assert wire.decode(wire.encode(reply), expect=PEER_NIXL_REPLIES) == reply
    many = msgspec.structs.replace(good, regions=[NixlRegion(4096 * i, 4096)
                                                  for i in range(1, 66)])
    with pytest.raises(ProtocolError, match=r"offer\.regions"):
        wire.decode(wire.encode(PeerNixlOffer(req=3, version=2, offer=many)),
                    expect=PEER_NIXL_REPLIES)
    with pytest.raises(ProtocolError, match=r"offer\.agent"):
        wire.decode(wire.encode(PeerNixlOffer(req=3, version=2, offer=msgspec.structs.replace(
            good, agent=""))), expect=PEER_NIXL_REPLIES)
