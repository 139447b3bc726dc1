"""Protocol 4 (a chunk's payload may follow its header) meets protocol 3: a named error.

Protocol 3 sent every chunk reply as one frame, the payload copied behind its header
for each subscriber. Protocol 4 lets the header go as a 32-byte message of its own and
the payload as the next message, straight from the snapshot (``chunk_frame.FOLLOWS``);
each message is still one frame (protocol 2's two-frame replies could be torn by a
reconnect, and libzmq 4.3.5 then aborted). A protocol-3 subscriber would take a header
alone for an empty chunk, so the sides must not share a transfer, and each says so,
naming both versions: an old subscriber's requests get an ``error`` reply from a new
publisher (which an old decoder refuses by its ``p``), and a new subscriber refuses an
old publisher's replies and chunk frames with a ``ProtocolVersionError``, and carries
on with anything that speaks its version. Protocol 2's two-frame replies stay refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.peers.peer_server import PeerServer, PeerServerLimits, Served
from subscriber_ext.transport.peers.upload_budget import UploadBudget
from tests.transport.procs import det_weights, digests, wait_until
from tests.transport.test_hostile import SPEC, FakePublisher, RawClient, pack
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, ProtocolVersionError

pytestmark = pytest.mark.timeout(90)

OLD = 3
NEW = wire.PROTOCOL_VERSION
BOTH = f"protocol version {OLD} from the peer, this side speaks {NEW}"


def test_the_step_is_from_3_to_4() -> None:
    assert (OLD, NEW) == (3, 4)


def test_a_follows_header_is_a_message_of_its_own_and_its_payload_the_next() -> None:
    head = chunk_frame.header_frame(req=9, version=4, chunk=7, size=4352)
    assert len(head) == chunk_frame.HEADER_BYTES and chunk_frame.is_chunk(head)
    header = chunk_frame.parse(head)
    assert header == chunk_frame.ChunkHeader(req=9, version=4, chunk=7, size=4352,
                                             follows=True)
    pairing = chunk_frame.PayloadPairing()
    pairing.expect(header)
    payload = bytes(4352)
    assert pairing.take(payload, 0) == header and pairing.due is None
    assert chunk_frame.payload(payload, header).nbytes == 4352  # the whole message
    with pytest.raises(ProtocolError, match="32-byte header frame, expected|36-byte header"):
        chunk_frame.parse(head + b"tail")  # a follows header carries no payload
    for wrong, more in ((bytes(4351), 0), (bytes(4352), 1), (head, 0)):
        pairing.expect(header)
        with pytest.raises(ProtocolError, match="chunk 7 of version 4: .* its 4352-byte "
                                                "payload was due"):
            pairing.take(wrong, more)
        assert pairing.due is None  # the chunk is fetched again; the next message is new


# -- the chunk frame itself ----------------------------------------------------------------------
def test_a_chunk_frame_carries_header_and_payload_in_one_frame() -> None:
    payload = bytes(range(256)) * 17
    frame = chunk_frame.build(req=9, version=4, chunk=7, payload=payload)
    assert len(frame) == chunk_frame.HEADER_BYTES + len(payload) == 32 + len(payload)
    assert chunk_frame.is_chunk(frame) and not chunk_frame.is_chunk(pack({"t": "latest"}))
    assert chunk_frame.parse(frame) == chunk_frame.ChunkHeader(req=9, version=4, chunk=7,
                                                               size=len(payload))
    assert bytes(chunk_frame.payload(frame)) == payload
    empty = chunk_frame.build(req=1, version=1, chunk=0, payload=b"")
    assert chunk_frame.parse(empty).size == 0


def _patched(frame: bytearray, offset: int, value: bytes) -> bytes:
    out = bytearray(frame)
    out[offset: offset + len(value)] = value
    return bytes(out)


GOOD = chunk_frame.build(req=1, version=2, chunk=3, payload=b"x" * 100)
BAD_FRAMES = [
    ("another protocol", _patched(GOOD, 4, (2).to_bytes(2, "little")), "chunk.protocol"),
    ("a future protocol, short", b"WPck" + (9).to_bytes(2, "little"), "chunk.protocol"),
    ("short header", bytes(GOOD[:20]), "shorter than its header"),
    ("bad magic", b"WPcx" + bytes(GOOD[4:]), "bad magic"),
    ("flags", _patched(GOOD, 6, b"\x02\x00"), "chunk.flags"),
    ("follows, with bytes behind", _patched(GOOD, 6, b"\x01\x00"), "header frame"),
    ("size past the frame", _patched(GOOD, 28, (101).to_bytes(4, "little")), "chunk.size"),
    ("size short of the frame", bytes(GOOD) + b"!", "chunk.size"),
    ("version 0", _patched(GOOD, 16, bytes(8)), "version 0"),
    ("req past 2**63", _patched(GOOD, 8, b"\xff" * 8), "req"),
    ("chunk past the limit", _patched(GOOD, 24, b"\xff" * 4), "chunk.chunk"),
]


@pytest.mark.parametrize(("frame", "named"), [c[1:] for c in BAD_FRAMES],
                         ids=[c[0] for c in BAD_FRAMES])
def test_a_bad_chunk_frame_is_refused_by_name(frame: bytes, named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        chunk_frame.parse(frame)


def test_another_protocol_names_both_versions() -> None:
    with pytest.raises(ProtocolVersionError) as info:
        chunk_frame.parse(_patched(GOOD, 4, (OLD).to_bytes(2, "little")))
    assert (info.value.theirs, info.value.ours) == (OLD, NEW) and BOTH in str(info.value)
    old_header = pack({"t": "chunk", "req": 1, "version": 1, "chunk": 0, "size": 4}, OLD)
    with pytest.raises(ProtocolVersionError, match=f"chunk.p: {BOTH}"):
        wire.decode(old_header, expect=(wire.ErrorReply, wire.LatestReply))
    with pytest.raises(ProtocolVersionError, match=f"latest.p: {BOTH}"):
        wire.decode(pack({"t": "latest", "req": 5}, OLD))


# -- an old subscriber, a new publisher ----------------------------------------------------------
def test_an_old_subscriber_is_answered_with_an_error_naming_both_versions(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A protocol-3 DEALER's ``latest`` and ``fetch`` each get an ``error`` reply at once
    (silence would leave it waiting); its decoder refuses that reply by its ``p``, which
    is how it learns. The publisher logs both versions and serves on."""
    caplog.set_level(logging.WARNING, logger="weightpub.publisher")
    pub = make_pub(chunk_size=4096)
    version = pub.publish(det_weights(5, 1, SPEC))
    pub.wait_announced(version, timeout=30)
    ctx = zmq.Context()
    try:
        raw = RawClient(ctx, pub.endpoint)
        before = pub._server.bad_messages
        old_requests = [
            (7, {"t": "latest", "req": 7}),
            (8, {"t": "fetch", "req": 8, "publisher_id": pub.publisher_id, "version": version,
                 "chunks": [0]}),
        ]
        for req, body in old_requests:
            raw.send(pack(body, OLD))
            frames = raw.recv(timeout=10)  # an answer, never silence
            assert len(frames) == 1 and not chunk_frame.is_chunk(frames[0])
            reply = msgpack.unpackb(frames[0])
            assert reply["p"] == NEW  # a protocol-3 decoder refuses this by ``p``
            assert (reply["t"], reply["req"], reply["code"]) == ("error", req, "bad_request")
            assert f"protocol version {OLD} is not spoken here" in reply["message"]
            assert f"speaks {NEW}" in reply["message"]
        assert pub._server.bad_messages - before == len(old_requests)
        assert any(BOTH in record.getMessage() for record in caplog.records), caplog.text
        # the same connection, speaking protocol 4, is served as before
        assert isinstance(raw.call(wire.StatusRequest(req=9)), wire.StatusReply)
        good = raw.call(wire.FetchRequest(req=10, publisher_id=pub.publisher_id,
                                          version=version, chunks=(0,)))
        assert isinstance(good, chunk_frame.ChunkHeader) and len(raw.last_frames) == 1
        assert good.follows and len(raw.last_payload) == good.size
    finally:
        ctx.destroy(linger=0)
    assert pub._server.is_alive()
    sub = make_sub(pub.endpoint)
    staged = sub.wait_for_version(version, timeout=30)
    assert digests(staged.items()) == digests(det_weights(5, 1, SPEC).items())


# -- a new subscriber, an old publisher ----------------------------------------------------------
@pytest.fixture
def fake() -> Iterator[FakePublisher]:
    ctx = zmq.Context()
    server = FakePublisher(ctx)
    server.start()
    yield server
    server.stop.set()
    server.join(timeout=5)
    ctx.term()


def _status(sub: WeightSubscriber) -> dict[str, Any]:
    return sub.status()


def test_a_new_subscriber_names_both_versions_to_an_old_publisher(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    """Every reply and heartbeat of a protocol-3 publisher is refused by name; the
    subscriber keeps asking (the publisher may be upgraded) and closes promptly."""
    fake.protocol = OLD
    fake.latest_manifest = fake.manifest(det_weights(8, 1, SPEC), 1)
    fake.outbox.put(pack({"t": "heartbeat", "publisher_id": fake.publisher_id,
                          "started_at": fake.started_at, "latest_version": 1,
                          "sent_at": fake.started_at, "interval": 1.0}, OLD))
    sub = make_sub(fake.endpoint)
    wait_until(lambda: BOTH in (_status(sub)["last_error"] or ""), 15, "the version error")
    assert "latest_rep.p" in _status(sub)["last_error"]
    wait_until(lambda: fake.latest_requests >= 2, 15, "the subscriber asking again")
    status = _status(sub)
    assert status["failures"].get("ProtocolVersionError", 0) >= 1, status
    assert status["staged_version"] == 0 and fake.chunk_replies == 0


def test_old_two_frame_chunk_replies_are_refused_and_nothing_hangs(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    """A source that serves chunks in protocol 2's two frames: each is refused with a
    ``ProtocolVersionError`` naming both versions (both frames read and dropped, nothing
    staged); once it serves one-frame replies the same subscriber stages the version."""
    weights = det_weights(8, 1, SPEC)
    fake.latest_manifest = fake.manifest(weights, 1)
    fake.old_chunks = True
    sub = make_sub(fake.endpoint, request_timeout=1.0)
    two = f"protocol version 2 from the peer, this side speaks {NEW}"
    wait_until(lambda: f"chunk.p: {two}" in (_status(sub)["last_error"] or ""), 15,
               "the old chunk reply refused by name")
    assert fake.chunk_replies >= 1 and _status(sub)["staged_version"] == 0
    fake.old_chunks = False
    staged = sub.wait_for_version(1, timeout=60)
    assert digests(staged.items()) == digests(weights.items())


def test_protocol_3_chunk_frames_are_refused_by_name_then_4_is_staged(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    """A protocol-3 publisher's one-frame chunks (its ``latest`` already spoke 4 here, as
    a mixed fleet mid-upgrade may) are each refused naming both versions, nothing is
    staged; once its frames say 4 the same subscriber stages the version whole."""
    weights = det_weights(8, 1, SPEC)
    fake.latest_manifest = fake.manifest(weights, 1)
    fake.chunk_protocol = OLD
    sub = make_sub(fake.endpoint, request_timeout=1.0)
    wait_until(lambda: f"chunk.protocol: {BOTH}" in (_status(sub)["last_error"] or ""), 15,
               "the protocol-3 chunk frame refused by name")
    assert fake.chunk_replies >= 1 and _status(sub)["staged_version"] == 0
    assert _status(sub)["failures"].get("ProtocolVersionError", 0) >= 1
    fake.chunk_protocol = None
    staged = sub.wait_for_version(1, timeout=60)
    assert digests(staged.items()) == digests(weights.items())


# -- peers ---------------------------------------------------------------------------------------
def test_a_peer_server_answers_an_old_peer_with_an_error_and_serves_follows_replies() -> None:
    """A protocol-3 peer's fetch gets an ``error`` naming both versions (it moves on to its
    next source); a protocol-4 fetch gets the chunk as a ``FOLLOWS`` header message, then
    its payload message (a peer sends straight from its staging, no copy)."""
    ctx = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        for sock in (router, dealer):
            sock.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        chunk = memoryview(bytes(range(256)) * 16)
        server = PeerServer(router, lambda publisher_id, version, index: Served(chunk, None),
                            UploadBudget(None, None), PeerServerLimits())

        def exchange(body: bytes) -> bytes:
            dealer.send(body)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if router.poll(50):
                    server.on_readable(time.monotonic())
                server.pump(time.monotonic())
                if dealer.poll(50):
                    frames = dealer.recv_multipart()
                    assert len(frames) == 1  # every reply is one frame
                    return frames[0]
            raise AssertionError("no reply within 10s")

        fetch = {"t": "fetch", "req": 3, "publisher_id": "pub", "version": 2, "chunks": [0]}
        reply = msgpack.unpackb(exchange(pack(fetch, OLD)))
        assert (reply["p"], reply["t"], reply["req"], reply["code"]) == (NEW, "error", 3,
                                                                         "bad_request")
        assert f"protocol version {OLD} is not spoken here: this peer speaks {NEW}" \
            in reply["message"]
        assert server.bad_requests == 1
        frame = exchange(pack(dict(fetch, req=4)))
        header = chunk_frame.parse(frame)
        assert header == chunk_frame.ChunkHeader(req=4, version=2, chunk=0, size=len(chunk),
                                                 follows=True)
        assert dealer.poll(10_000)
        payload = dealer.recv_multipart()
        assert len(payload) == 1 and payload[0] == bytes(chunk)
    finally:
        ctx.destroy(linger=0)
