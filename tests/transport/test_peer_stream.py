"""Peers over the stream (``docs/peer-stream.md``): members forward verified chunks on a
plain TCP port of their own, with real processes and sockets.

Members join one at a time (``test_peers.join``): with ``peer_fanout=1`` they form a
chain (slot 0 from the publisher, 1 from 0, 2 from 1 then from 0).
"""

from __future__ import annotations

import re
import socket
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from publisher import WeightPublisher
from publisher.publisher_metrics import PublisherCollector
from tests.transport.procs import REPO, Child, det_weights, wait_until
from tests.transport.test_peers import (
    BIG,
    CHUNK,
    SEED,
    SPEC,
    join,
    peer_dealer,
    peers_status,
    staged_ok,
)
from tests.unit.scrape import worker_view
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.keys import create_key_pair

pytestmark = pytest.mark.timeout(120)

#: the release before peers over the stream (its members know no ``peer_stream``)
BEFORE_PEER_STREAM = "d740a75c89efa5743ca7956c114c64613a996863"


def _options(stream: bool = True, timeout: float = 10.0) -> dict[str, Any]:
    return {"options": {"stream": stream, "request_timeout": timeout, "report_interval": 0.3}}


def _streaming(index: int) -> dict[str, Any]:
    return _options()


def _publish(pub: WeightPublisher, members: list[Child], versions: tuple[int, ...],
             spec: list[Any]) -> list[int]:
    """Publish ``versions``, each staged bit-exact by every member; their sizes."""
    sizes = []
    for version in versions:
        pub.publish(det_weights(SEED, version, spec), version=version)
        for child in members:
            staged_ok(child, version)
        sizes.append(pub.manifest(version).total_bytes)
    return sizes


def _until_streamed(pub: WeightPublisher, members: list[Child], spec: list[Any],
                    most: int = 4) -> tuple[int, list[int]]:
    """Publish versions 1, 2, ... until one came to every member after the first whole
    over its peer's stream (a version published before a peer's CURVE handshake, token
    and connection came goes partly as frames, or from the publisher); at
    most ``most``. The version, and every version's size."""
    sizes: list[int] = []
    before = [0] * len(members)
    for version in range(1, most + 1):
        sizes += _publish(pub, members, (version,), spec)
        now = [peers_status(c)["peers"]["stream_bytes_from_peers"] for c in members]
        if all(n - b >= sizes[-1] for n, b in zip(now[1:], before[1:], strict=True)):
            return version, sizes
        before = now
    raise AssertionError(f"no version of {most} came whole over the peers' streams: "
                         f"{[_streamed(peers_status(c)['peers']) for c in members]}")


def _streamed(peers: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in peers.items() if "stream" in key}


def test_a_chain_of_two_forwards_over_the_stream_bit_exact(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], tmp_path: Path,
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = join(spawn, pub, 2, SPEC, _streaming)
    _, sizes = _until_streamed(pub, [first, second], SPEC)
    asker, server = peers_status(second)["peers"], peers_status(first)["peers"]
    assert not asker["stream_fallback_causes"], _streamed(asker)
    assert server["stream_served"]["stream_bytes_sent"] == asker["stream_bytes_from_peers"]
    assert server["stream_served"]["stream_tokens_issued"] == 1  # one connection, kept
    assert asker["bytes_from_peers"] == sum(sizes), asker  # every byte from its peer
    assert pub.data_stats()["bytes_sent_full"] == sum(sizes)  # each chunk left it once
    # on each member's replica /metrics, as its worker writes the status file
    served = _metrics(first, tmp_path / "first")
    asked = _metrics(second, tmp_path / "second")
    assert served["weightpub_peer_stream_sent_bytes_total"] == \
        asked["weightpub_stream_bytes_from_peers_total"] == asker["stream_bytes_from_peers"]
    assert asked["weightpub_stream_chunks_from_peers_total"] == \
        served["weightpub_peer_stream_sent_chunks_total"] > 0
    assert served["weightpub_peer_stream_tokens_issued_total"] == 1
    assert served["weightpub_peer_stream_cut_total"] == 0
    assert served['weightpub_peer_stream_cpu_seconds_total{part="sends"}'] >= 0
    assert asked["weightpub_peer_stream_sent_bytes_total"] == 0  # no one asks the last
    assert not any(key.startswith("weightpub_peer_stream_fallbacks") for key in asked)
    # in the reports the publisher sums: its fleet total, each member's row, its /metrics
    sent = server["stream_served"]
    got = wire.PeerStreamFigures(bytes_from_peers=asker["stream_bytes_from_peers"],
                                 chunks_from_peers=asker["stream_chunks_from_peers"])
    wait_until(lambda: pub.peer_stream_totals() == wire.PeerStreamFigures(
        bytes_from_peers=got.bytes_from_peers, chunks_from_peers=got.chunks_from_peers,
        bytes_served=sent["stream_bytes_sent"], chunks_served=sent["stream_chunks_sent"]),
        20, f"the members' reports of what they moved over the stream: {got}, {sent}")
    rows = {r.subscriber_id: r.peer_stream for r in pub.fleet()}
    assert rows == {"m0": wire.PeerStreamFigures(bytes_served=sent["stream_bytes_sent"],
                                                 chunks_served=sent["stream_chunks_sent"]),
                    "m1": got}
    fleet = {m.name: m.samples[0].value for m in PublisherCollector(pub._figures).collect()
             if m.samples}
    assert fleet["weightpub_publisher_fleet_stream_bytes_from_peers"] == \
        fleet["weightpub_publisher_fleet_peer_stream_sent_bytes"] == got.bytes_from_peers > 0


class _Source:
    """A member child as a worker's version source (its status, over the child's RPC)."""

    def __init__(self, child: Child) -> None:
        self.child = child

    def status(self) -> dict[str, Any]:
        return peers_status(self.child)


def _metrics(child: Child, board: Path) -> dict[str, float]:
    """The member's samples on a replica's /metrics (rank 0; the label left out)."""
    _, text = worker_view(_Source(child), board)
    return {re.sub(r'\{rank="0"\}|,?rank="0",?', "", line.rsplit(" ", 1)[0]):
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_the_first_version_comes_whole_over_the_stream_asked_when_the_plan_came(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    """The token is asked when the plan names the peer (``PeerStreamSource.warm``), not
    at the first chunk: the connection is up before version 1, which comes whole over it."""
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = join(spawn, pub, 2, SPEC, _streaming)
    wait_until(lambda: peers_status(second)["peers"]["stream_peers_up"] == 1, 20,
               "the second member's stream to the first up, before any version")
    (size,) = _publish(pub, [first, second], (1,), SPEC)
    asker = peers_status(second)["peers"]
    assert asker["stream_bytes_from_peers"] == asker["bytes_from_peers"] == size, \
        _streamed(asker)  # not one frame from its peer
    assert asker["stream_fallbacks"] == 0 and not asker["stream_fallback_causes"], asker
    assert peers_status(first)["peers"]["stream_served"]["stream_tokens_issued"] == 1


def test_a_chain_of_three_forwards_cut_through_over_the_stream(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    members = join(spawn, pub, 3, BIG, _streaming)
    _, sizes = _until_streamed(pub, members, BIG)  # a version whole over both hops
    statuses = [peers_status(child)["peers"] for child in members]
    for upstream in statuses[:2]:
        assert upstream["stream_served"]["stream_bytes_sent"] >= sizes[-1], upstream
        assert upstream["stream_served"]["stream_cut"] == 0
    # the middle member served chunks of version 2 it was still receiving: it never
    # answered "not here" (a chunk not verified yet waited for it)
    assert statuses[1]["stream_served"]["stream_unavailable"] == 0
    assert pub.data_stats()["bytes_sent_full"] == sum(sizes)


@pytest.mark.parametrize("old", ["asker", "server"])
def test_a_member_without_the_stream_keeps_to_frames_counted(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], old: str,
    tmp_path: Path,
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = join(spawn, pub, 2, SPEC, lambda i: _options(
        stream=(i == 0) == (old == "asker")))
    sizes = _publish(pub, [first, second], (1, 2), SPEC)
    asker, server = peers_status(second)["peers"], peers_status(first)["peers"]
    assert asker["bytes_from_peers"] == sum(sizes), asker  # all of it over frames
    assert asker.get("stream_bytes_from_peers", 0) == 0
    if old == "asker":  # it never asks: the server's port stays unused
        assert server["stream_served"]["stream_tokens_issued"] == 0
        assert "stream_fallbacks" not in asker
    else:  # it asked once, was told why not, and kept to frames (QUIET_S)
        assert server["stream_served"] is None and server["stream_tokens"] == 0
        assert asker["stream_fallback_causes"] == {"refused": 1}, asker
        assert "the peer stream is off here" in asker["stream_last_error"]
        asked = _metrics(second, tmp_path)  # the cause, a bounded label on /metrics
        assert asked['weightpub_peer_stream_fallbacks_total{cause="refused"}'] == 1
        wait_until(lambda: (pub.peer_stream_totals() or wire.PeerStreamFigures()).fallbacks
                   == (("refused", 1),), 20, "the asker's report of the cause")


def test_kill_9_of_the_forwarding_member_mid_version_costs_nothing_partial(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, middle, last = join(spawn, pub, 3, BIG, lambda i: {
        **_options(timeout=2.0), **({"peer": {"upload_mbit": 4}} if i == 1 else {})})
    pub.publish(det_weights(SEED, 1, BIG), version=1)
    staged_ok(first, 1)
    wait_until(lambda: peers_status(last)["peers"]["stream_bytes_from_peers"] > 0, 30,
               "the transfer over the middle member's stream")
    middle.kill9()
    staged_ok(last, 1, timeout=30)  # complete and bit-exact, from the others
    status = peers_status(last)
    assert status["peers"]["stream_fallbacks"] >= 1, status["peers"]
    assert [e["version"] for e in last.events if e.get("event") == "staged"] == [1]
    assert status["checksum_failures"] == 0


@pytest.mark.parametrize("fault", ["corrupt", "short"])
def test_a_corrupt_or_short_chunk_on_the_stream_is_caught_and_fetched_again(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], fault: str,
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = join(spawn, pub, 2, SPEC, lambda i: {
        **_options(), **({"stream_corrupt": fault == "corrupt" or fault} if i == 0 else {})})
    _publish(pub, [first, second], (1, 2), SPEC)  # bit-exact all the same
    asker = peers_status(second)
    causes = asker["peers"]["stream_fallback_causes"]
    if fault == "corrupt":  # the checksum caught it
        assert causes.get("checksum", 0) >= 1 and asker["checksum_failures"] >= 1, causes
    else:  # the size in the reply is not the chunk's: the connection is dropped
        assert causes.get("bad_reply", 0) >= 1, causes
        assert "the manifest says" in asker["peers"]["stream_last_error"]
    assert asker["peers"]["stream_bytes_from_peers"] == 0  # not one bad chunk staged


def test_curve_an_admitted_key_gets_a_stream_token_a_stranger_nothing(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], tmp_path: Any,
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = map(str, create_key_pair(tmp_path, "server"))
    secrets = [str(create_key_pair(allowed, f"member{i}")[1]) for i in range(2)]
    stranger_secret = str(create_key_pair(tmp_path, "stranger")[1])
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, curve_secret_key_file=server_secret,
                   curve_allowed_clients_dir=str(allowed))
    members = join(spawn, pub, 2, SPEC, lambda i: {**_options(), "peer": {
        "curve_server_key_file": server_public, "curve_secret_key_file": secrets[i]}})
    version, _ = _until_streamed(pub, members, SPEC)  # CURVE members: over the stream

    import zmq.auth

    manifest = pub.manifest(version)
    endpoint = peers_status(members[0])["peers"]["endpoint"]
    server_key, _ = zmq.auth.load_certificate(secrets[0])

    def token(client_secret: str | None, wait: float) -> stream_link.StreamToken | None:
        with peer_dealer(endpoint, server_key, client_secret) as dealer:
            dealer.send(wire.encode(stream_link.PeerStreamRequest(
                req=7, publisher_id=manifest.publisher_id)))
            if not dealer.poll(int(wait * 1000)):
                return None
            return wire.decode_as(dealer.recv(), stream_link.StreamToken)

    granted = token(secrets[1], 20)  # a member the tracker vouched for
    assert granted is not None and granted.req == 7
    assert token(stranger_secret, 3) is None  # a key the publisher never saw
    assert token(None, 3) is None  # no CURVE at all

    host = endpoint.split("//")[1].rsplit(":", 1)[0]
    with socket.create_connection((host, granted.port), timeout=10) as conn:
        conn.sendall(stream_link.hello(granted.token))
        assert stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES)).status == \
            stream_link.ACCEPTED
        conn.sendall(stream_link.request(1, version, [0]))
        reply = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
        assert reply.status == stream_link.OK and reply.chunk == 0
        assert chunk_checksum(memoryview(_read(conn, reply.size))) == manifest.checksums[0]
    with socket.create_connection((host, granted.port), timeout=10) as conn:
        conn.sendall(stream_link.hello(granted.token))  # a token is good once
        assert stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES)).status == \
            stream_link.REFUSED


def _read(conn: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        piece = conn.recv(nbytes - len(data))
        assert piece, "the member closed the stream"
        data += piece
    return bytes(data)


# -- the release before peers over the stream, from git ------------------------------------------
@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tree = tmp_path_factory.mktemp("before-peer-stream")
    archive = tree / "tree.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive),
                    BEFORE_PEER_STREAM], check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    yield tree


@pytest.mark.parametrize("old", ["server", "asker"])
def test_a_member_of_the_release_before_and_a_new_one_share_over_frames(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
    closing: Callable[[Any], Any], old_tree: Path, old: str,
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    members: list[Child] = []
    for index in range(2):
        args = {"endpoint": pub.endpoint, "seed": SEED, "spec": SPEC, "name": f"m{index}",
                **_options(timeout=2.0)}
        if (index == 0) == (old == "server"):
            child = closing(Child("peer", args, repo=old_tree))
        else:
            child = spawn("peer", **args)
        child.event("ready", timeout=60)
        wait_until(lambda c=child, i=index: peers_status(c)["peers"]["slot"] == i, 20,
                   f"member {index} to get slot {index}")
        members.append(child)
    wait_until(lambda: peers_status(members[1])["peers"]["sources"], 20, "the final plan")
    sizes = _publish(pub, members, (1, 2), SPEC)
    asker = peers_status(members[1])["peers"]
    assert asker["bytes_from_peers"] == sum(sizes), asker  # all of it over the peer's frames
    if old == "server":  # it dropped the token request (an unknown "t"): counted once
        assert asker["stream_bytes_from_peers"] == 0
        wait_until(lambda: peers_status(members[1])["peers"]["stream_fallback_causes"]
                   == {"no_answer": 1}, 20, "no_answer counted (request_timeout 2 s)")
    else:  # the old asker never asks: the new member's port stays unused
        assert peers_status(members[0])["peers"]["stream_served"]["stream_tokens_issued"] == 0


# -- the member's stream port alone, in this process: the buffer counts -------------------------
MIB = 1 << 20


class _Port:
    """A ``PeerStreamServer`` over one pooled staging buffer of ``chunks`` chunks; the test
    thread plays the subscriber's (``pump``) and the asker (a plain socket)."""

    def __init__(self, chunks: int, limits: Any = None) -> None:
        import torch

        from subscriber_ext.transport.peers.peer_server import GONE, WAIT, PeerServerLimits, Served
        from subscriber_ext.transport.peers.peer_stream_server import PeerStreamServer
        from subscriber_ext.transport.peers.upload_budget import UploadBudget
        from weightpub_wire.buffers import BufferPool, byte_view

        self.pool = BufferPool(max_buffers=2, pinned=False)
        self.buffer = self.pool.take(chunks * MIB)
        self.buffer.copy_(torch.arange(chunks * MIB, dtype=torch.int64).to(torch.uint8))
        self.view = byte_view(self.buffer)
        self.verified = set(range(chunks))

        def lookup(publisher_id: str, version: int, chunk: int) -> Any:
            if publisher_id != "pub" or version != 1:
                return GONE
            if chunk not in self.verified:
                return WAIT
            return Served(self.view[chunk * MIB: (chunk + 1) * MIB], self.buffer)

        self.server = PeerStreamServer("127.0.0.1", lookup, UploadBudget(None, None),
                                       limits or PeerServerLimits(), sends=self.pool)
        token = self.server.issue_token(None, "pub")
        assert token is not None
        self.conn = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        self.conn.sendall(stream_link.hello(token))
        assert stream_link.parse_reply(_read(self.conn, stream_link.REPLY_BYTES)).status == \
            stream_link.ACCEPTED

    def reply(self) -> tuple[stream_link.StreamReply, bytes]:
        """The next reply, the pump run (as the subscriber's loop would) until it comes."""
        import time

        self.conn.settimeout(0.01)
        head = bytearray()
        deadline = time.monotonic() + 20
        while len(head) < stream_link.REPLY_BYTES:
            assert time.monotonic() < deadline, "a reply within 20 s"
            self.server.pump(time.monotonic())
            try:
                piece = self.conn.recv(stream_link.REPLY_BYTES - len(head))
            except TimeoutError:
                continue
            assert piece, "the port closed the connection"
            head += piece
        reply = stream_link.parse_reply(head)
        self.conn.settimeout(10)
        return reply, _read(self.conn, reply.size) if reply.size else b""

    def close(self) -> None:
        self.conn.close()
        self.server.close()


def test_the_port_sends_verified_chunks_cut_through_and_ends_their_counts() -> None:
    port = _Port(4)
    try:
        port.verified.discard(2)  # not verified yet: it waits, the others go
        port.conn.sendall(stream_link.request(5, 1, [1, 2]))
        reply, data = port.reply()
        assert (reply.status, reply.req, reply.chunk) == (stream_link.OK, 5, 1)
        assert data == bytes(port.view[MIB: 2 * MIB])
        port.verified.add(2)  # verified now: the waiting request goes on at once
        port.server.changed()
        reply, data = port.reply()
        assert (reply.status, reply.chunk, data) == (stream_link.OK, 2,
                                                     bytes(port.view[2 * MIB: 3 * MIB]))
        wait_until(lambda: port.pool.sends_in_flight == 0, 10, "the sends' counts ended")
        port.conn.sendall(stream_link.request(6, 2, [0]))  # a version it will not have
        reply, _ = port.reply()
        assert (reply.status, reply.req) == (stream_link.UNAVAILABLE, 6)
        stats = port.server.stats()
        assert stats["stream_bytes_sent"] == 2 * MIB and stats["stream_unavailable"] == 1
    finally:
        port.close()


def test_a_reader_that_stops_is_cut_so_the_buffer_given_back_drains() -> None:
    import time

    from subscriber_ext.transport.peers.peer_server import PeerServerLimits

    port = _Port(32, PeerServerLimits(drain_grace=0.3, stall_timeout=60.0))
    try:
        port.conn.sendall(stream_link.request(1, 1, list(range(32))))  # and reads nothing
        wait_until(lambda: (port.server.pump(time.monotonic()) or True)
                   and port.pool.sends_in_flight > 0 and port.server.stats()[
                       "stream_bytes_sent"] < 32 * MIB, 20, "a send blocked on the reader")
        key = port.buffer.data_ptr()
        port.pool.give(port.buffer)  # the version is over: the buffer waits for the send
        assert port.pool.draining(key)
        wait_until(lambda: (port.server.pump(time.monotonic()) or True)
                   and port.server.stats()["stream_cut"] == 1, 20, "the stalled reader cut")
        wait_until(lambda: not port.pool.draining(key) and port.pool.sends_in_flight == 0, 10,
                   "the buffer drained")
    finally:
        port.close()
