"""Hostile peers: garbage and malformed messages are refused; both sides keep serving."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
import xxhash
import zmq

from publisher import ProtocolError, WeightPublisher
from subscriber_ext import SyncOptions, WeightSubscriber
from tests.transport.procs import as_bytes, det_weights, digests, wait_until
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.dtypes import dtype_name
from weightpub_wire.protocol import TENSOR_ALIGN, Limits, TensorEntry

pytestmark = pytest.mark.timeout(60)

SPEC = [("w", "float32", [64, 1000]), ("b", "bfloat16", [777])]


def pack(body: dict[str, Any], protocol: int = wire.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"p": protocol, **body}, use_bin_type=True)


class RawClient:
    """A bare DEALER speaking to a publisher's ROUTER; every receive has a timeout."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 10.0) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply within {timeout}s")
        return self.sock.recv_multipart()

    def call(self, message: wire.Message) -> wire.Message | chunk_frame.ChunkHeader:
        self.send(wire.encode(message))
        frames = self.recv()
        self.last_frames = frames
        if chunk_frame.is_chunk(frames[0]):
            header = chunk_frame.parse(frames[0])
            if header.follows:  # protocol 4: the payload is the next message, alone
                payload = self.recv()
                assert len(payload) == 1, "a payload message is one frame"
                self.last_payload = payload[0]
            else:
                self.last_payload = bytes(chunk_frame.payload(frames[0]))
            return header
        return wire.decode(frames[0])


def test_garbage_to_publisher_router_is_refused_and_service_continues(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=4096)
    version = pub.publish(det_weights(5, 1, SPEC))
    pub.wait_announced(version, timeout=30)
    ctx = zmq.Context()
    try:
        raw = RawClient(ctx, pub.endpoint)
        latest = raw.call(wire.LatestRequest(req=1))
        assert isinstance(latest, wire.LatestReply) and latest.manifest is not None
        num_chunks = latest.manifest.num_chunks
        before = pub._server.bad_messages

        dropped = [
            (b"two", b"frames"),  # wrong frame count
            (b"a", b"b", b"c"),
            (b"",),  # empty body
            (b"\xc1\xc1 not msgpack",),
            (msgpack.packb([1, 2, 3]),),  # not a map
            (pack({"t": "fetch", "req": 1}),),  # missing fields
            (pack({"t": "no-such-type", "req": 1}),),
            (bytes(chunk_frame.build(req=1, version=1, chunk=0, payload=b"")),),  # wrong way
            (wire.encode(latest.manifest),),  # a manifest is not a request
            (pack({"t": "fetch", "req": 2, "publisher_id": pub.publisher_id, "version": 1,
                   "chunks": list(range(5000))}),),  # more ids than any fetch may carry
            (pack({"t": "report", "subscriber_id": "x\x00y", "staged_version": 1,
                   "applied_version": 1}),),
            (b"\x00" * 60_000,),  # garbage just under the request size limit
        ]
        for frames in dropped:
            raw.send(*frames)
        # requests are handled in order: once this is answered, all of the above were seen
        assert isinstance(raw.call(wire.StatusRequest(req=3)), wire.StatusReply)
        assert pub._server.bad_messages - before == len(dropped)

        def fetch(**fields: Any) -> wire.Message:
            request = dict(req=4, publisher_id=pub.publisher_id, version=version, chunks=(0,))
            request.update(fields)
            return raw.call(wire.FetchRequest(**request))

        out_of_range = fetch(chunks=(num_chunks,))
        assert isinstance(out_of_range, wire.ErrorReply) and out_of_range.code == "bad_request"
        too_many = fetch(chunks=(0,) * 300)  # within the wire limit, over the server's
        assert isinstance(too_many, wire.ErrorReply) and too_many.code == "bad_request"
        unknown = fetch(version=99)
        assert isinstance(unknown, wire.ErrorReply) and unknown.code == "version_unavailable"
        assert unknown.req == 4 and unknown.version == 99
        other = fetch(publisher_id="someone-else")
        assert isinstance(other, wire.ErrorReply) and other.code == "version_unavailable"

        good = fetch(chunks=(0,))  # the same socket is still served
        assert isinstance(good, chunk_frame.ChunkHeader) and good.chunk == 0
        # protocol 4: a 32-byte header message, then the payload message from the snapshot
        assert good.follows and [len(f) for f in raw.last_frames] == [chunk_frame.HEADER_BYTES]
        assert len(raw.last_payload) == good.size == 4096
        assert pub._server.is_alive()
    finally:
        ctx.destroy(linger=0)

    # and a real subscriber is served normally afterwards
    sub = make_sub(pub.endpoint)
    pub.publish(det_weights(5, 2, SPEC))
    staged = sub.wait_for_version(2, timeout=30)
    assert digests(staged.items()) == digests(det_weights(5, 2, SPEC).items())


# -- a fake publisher whose messages the test controls ---------------------------------------
def manifest_for(weights: dict[str, torch.Tensor], version: int, chunk_size: int,
                 publisher_id: str, started_at: float) -> tuple[wire.Manifest, bytes]:
    """Lay out and hash a version by hand (independently of the publisher's code)."""
    entries, pieces, offset = [], [], 0
    for name, tensor in weights.items():
        raw = as_bytes(tensor).numpy().tobytes()
        entries.append(TensorEntry(name=name, dtype=dtype_name(tensor.dtype),
                                   shape=tuple(tensor.shape), offset=offset, nbytes=len(raw)))
        padded = -(-len(raw) // TENSOR_ALIGN) * TENSOR_ALIGN
        pieces.append(raw + b"\0" * (padded - len(raw)))
        offset += padded
    data = b"".join(pieces)
    manifest = wire.Manifest(
        publisher_id=publisher_id, started_at=started_at, version=version,
        created_at=time.time(), model_id="fake", chunk_size=chunk_size,
        total_bytes=len(data), tensors=tuple(entries),
        checksums=tuple(xxhash.xxh3_64_intdigest(data[i: i + chunk_size])
                        for i in range(0, len(data), chunk_size)),
    )
    return manifest, data


class FakePublisher(threading.Thread):
    """ROUTER + PUB written by hand: answers ``latest`` with ``latest_manifest`` (a raw,
    possibly malformed wire dict), serves chunks of ``data[version]``, and publishes
    whatever is put into ``outbox`` on PUB. ``protocol`` is the ``p`` of its ``latest``
    replies; ``old_chunks`` serves chunks as protocol 2 did (two frames, ``p`` 2);
    ``chunk_protocol`` stamps its one-frame chunks with another protocol (3: inline only)."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="test-fake-publisher", daemon=True)
        self.router = ctx.socket(zmq.ROUTER)
        self.pub = ctx.socket(zmq.PUB)
        for sock in (self.router, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.publisher_id = "fake-publisher"
        self.started_at = time.time()
        self.latest_manifest: dict[str, Any] | None = None
        self.data: dict[int, bytes] = {}
        self.outbox: queue.Queue[bytes] = queue.Queue()
        self.latest_requests = 0
        self.evicted: set[int] = set()  # fetches of these get a version_unavailable error
        self.protocol = wire.PROTOCOL_VERSION
        self.old_chunks = False
        self.chunk_protocol: int | None = None  # one-frame chunks stamped with this protocol
        self.chunk_replies = 0
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.router.poll(20):
                    self._serve(*self.router.recv_multipart())
                while not self.outbox.empty():
                    self.pub.send(self.outbox.get())
        finally:
            self.router.close()
            self.pub.close()

    def _serve(self, identity: bytes, body: bytes, *extra: bytes) -> None:
        try:
            request = wire.decode(body)
        except ProtocolError:
            return
        if isinstance(request, wire.LatestRequest):
            self.latest_requests += 1
            reply = {"t": "latest_rep", "req": request.req, "publisher_id": self.publisher_id,
                     "started_at": self.started_at, "pub_endpoint": self.pub_endpoint,
                     "heartbeat_interval": 1.0, "manifest": self.latest_manifest}
            self.router.send_multipart([identity, pack(reply, self.protocol)])
        elif isinstance(request, wire.FetchRequest):
            if request.version in self.evicted:
                error = wire.ErrorReply(req=request.req, code="version_unavailable",
                                        message=f"version {request.version} was evicted",
                                        version=request.version)
                self.router.send_multipart([identity, wire.encode(error)])
                return
            data = self.data[request.version]
            chunk_size = self.latest_manifest["chunk_size"] if self.latest_manifest else 0
            for chunk in request.chunks:
                piece = data[chunk * chunk_size: (chunk + 1) * chunk_size]
                self.chunk_replies += 1
                if self.old_chunks:  # protocol 2: [msgpack header][payload]
                    header = pack({"t": "chunk", "req": request.req, "version": request.version,
                                   "chunk": chunk, "size": len(piece)}, protocol=2)
                    self.router.send_multipart([identity, header, piece])
                    continue
                frame = chunk_frame.build(req=request.req, version=request.version,
                                          chunk=chunk, payload=piece)
                if self.chunk_protocol is not None:  # an older (or newer) publisher's frame
                    frame[4:6] = self.chunk_protocol.to_bytes(2, "little")
                self.router.send_multipart([identity, frame])

    def manifest(self, weights: dict[str, torch.Tensor], version: int,
                 chunk_size: int = 4096) -> dict[str, Any]:
        manifest, data = manifest_for(weights, version, chunk_size, self.publisher_id,
                                      self.started_at)
        self.data[version] = data
        return msgpack.unpackb(wire.encode(manifest))

    def publish_raw(self, body: dict[str, Any]) -> None:
        self.outbox.put(pack({"t": "manifest", **body}))


@pytest.fixture
def fake() -> Any:
    ctx = zmq.Context()
    server = FakePublisher(ctx)
    server.start()
    yield server
    server.stop.set()
    server.join(timeout=5)
    ctx.term()


def _error(sub: WeightSubscriber) -> str:
    return sub.status()["last_error"] or ""


def test_malformed_manifest_is_named_and_subscriber_recovers(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    v1 = det_weights(8, 1, SPEC)
    good_v1 = fake.manifest(v1, 1)
    bad_v1 = dict(good_v1, tensors=[dict(good_v1["tensors"][0], dtype="complex128"),
                                    *good_v1["tensors"][1:]])
    fake.latest_manifest = bad_v1

    sub = make_sub(fake.endpoint, request_timeout=1.0)
    wait_until(lambda: "manifest.tensors[0].dtype" in _error(sub), 30,
               "the bad latest reply to be reported")
    assert sub.status()["bad_messages"] >= 1
    assert sub.latest() is None and sub._thread.is_alive()

    fake.latest_manifest = good_v1  # the subscriber re-asks while it is not in sync
    staged = sub.wait_for_version(1, timeout=30)
    assert digests(staged.items()) == digests(v1.items())

    # the same on the PUB socket: a malformed v2 is refused, naming the field ...
    v2 = det_weights(8, 2, SPEC)
    good_v2 = fake.manifest(v2, 2)
    bad_v2 = dict(good_v2, tensors=[dict(good_v2["tensors"][0], nbytes=12),
                                    *good_v2["tensors"][1:]])

    def bad_one_seen() -> bool:
        fake.publish_raw(bad_v2)  # repeated: PUB drops what is sent before SUB connects
        return "manifest.tensors[0].nbytes" in _error(sub)

    wait_until(bad_one_seen, 30, "the malformed PUB manifest to be reported", interval=0.05)
    fake.outbox.put(b"\x92\x01\x02")  # and plain garbage on PUB
    fake.outbox.put(pack({"t": "latest", "req": 1}))  # a request type where none belongs
    assert sub.latest().version == 1 and sub._thread.is_alive()

    # ... and a valid v2 afterwards is staged
    fake.latest_manifest = good_v2

    def staged_v2() -> bool:
        fake.publish_raw(good_v2)
        latest = sub.latest()
        return latest is not None and latest.version == 2

    wait_until(staged_v2, 30, "the valid version 2", interval=0.1)
    assert digests(sub.latest().items()) == digests(v2.items())
    for name, want in v2.items():
        assert torch.equal(as_bytes(sub.latest().tensors[name]), as_bytes(want))


def test_manifest_over_the_size_limit_is_refused_without_allocating(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    takes: list[int] = []
    original_take = BufferPool.take

    def recording_take(self: BufferPool, nbytes: int, **kwargs: Any) -> torch.Tensor:
        takes.append(nbytes)
        return original_take(self, nbytes, **kwargs)

    monkeypatch.setattr(BufferPool, "take", recording_take)

    huge = 8 << 30  # 8 GiB announced; nothing of it is ever sent
    chunk = 1 << 30
    fake.latest_manifest = {
        "publisher_id": fake.publisher_id, "started_at": fake.started_at, "version": 1,
        "created_at": time.time(), "model_id": "fake", "chunk_size": chunk,
        "total_bytes": huge,
        "tensors": [{"name": "w", "dtype": "uint8", "shape": [huge], "offset": 0,
                     "nbytes": huge}],
        "checksums": [0] * (huge // chunk),
        "checksum_algorithm": wire.CHECKSUM_ALGORITHM,
    }
    options = SyncOptions(request_timeout=1.0, limits=Limits(max_total_bytes=64 << 20))
    sub = make_sub(fake.endpoint, options=options)
    wait_until(lambda: "manifest.total_bytes" in _error(sub), 30, "the refusal")
    wait_until(lambda: fake.latest_requests >= 2, 30, "a second attempt")  # still refused
    assert "manifest.total_bytes" in _error(sub)
    assert takes == []
    status = sub.status()
    assert status["fetching_version"] is None and status["staged_version"] == 0
    assert sub.latest() is None and sub._thread.is_alive()

    # within the limit, the same subscriber takes a real version
    small = det_weights(9, 2, SPEC)
    fake.latest_manifest = fake.manifest(small, 2)
    staged = sub.wait_for_version(2, timeout=30)
    assert digests(staged.items()) == digests(small.items())
    assert takes and max(takes) <= 64 << 20


def test_empty_tensor_with_overflowing_shape_does_not_wedge_the_subscriber(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    """0 bytes, but torch cannot build a view of shape (2**40, 2**40, 2**40, 0): refused at
    decode, instead of failing at staging and leaving a finished-but-stuck target behind."""
    weights = det_weights(10, 1, SPEC)
    good = fake.manifest(weights, 1)
    end = good["total_bytes"]
    fake.latest_manifest = dict(good, tensors=[
        *good["tensors"],
        {"name": "empty", "dtype": "float32", "shape": [1 << 40, 1 << 40, 1 << 40, 0],
         "offset": end, "nbytes": 0},
    ])
    sub = make_sub(fake.endpoint, request_timeout=1.0)
    wait_until(lambda: "manifest.tensors[2].shape" in _error(sub), 30, "the refusal")
    assert sub.status()["fetching_version"] is None

    fake.latest_manifest = good
    staged = sub.wait_for_version(1, timeout=30)
    assert digests(staged.items()) == digests(weights.items())


@pytest.mark.timeout(60)
def test_oversized_frame_is_cut_off_before_it_is_buffered() -> None:
    """A 32 MiB 'request' exceeds the ROUTER's MAXMSGSIZE: ZeroMQ drops that peer
    before handing us the frame (nothing is decoded), and the publisher keeps serving."""
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        ctx = zmq.Context()
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.connect(pub.endpoint)
        hostile.send(b"x" * (32 << 20))
        time.sleep(0.5)
        weights = {"w": torch.randn(64)}
        version = pub.publish(weights)
        with WeightSubscriber(pub.endpoint) as sub:
            assert torch.equal(sub.wait_for_version(version, timeout=20).tensors["w"],
                               weights["w"])
        assert pub._server.bad_messages == 0
        hostile.close()
        ctx.term()


def test_a_version_the_publisher_no_longer_holds_is_reported_as_version_unavailable(
    fake: FakePublisher, make_sub: Callable[..., WeightSubscriber],
) -> None:
    weights = det_weights(12, 1, SPEC)
    fake.latest_manifest = fake.manifest(weights, 1)
    fake.evicted.add(1)
    sub = make_sub(fake.endpoint, request_timeout=1.0)
    wait_until(lambda: _error(sub).startswith("VersionUnavailable: "), 30, "the refusal")
    assert "version 1 was evicted" in _error(sub)
    assert sub.latest() is None
    fake.evicted.clear()  # the back-off expires and the version is fetched after all
    staged = sub.wait_for_version(1, timeout=30)
    assert digests(staged.items()) == digests(weights.items())


def test_publisher_manifest_raises_version_unavailable_once_evicted(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    from publisher import VersionUnavailable

    pub = make_pub(keep_versions=1)
    first = pub.publish(det_weights(13, 1, SPEC))
    pub.wait_announced(first, timeout=30)
    assert pub.manifest(first).version == first
    second = pub.publish(det_weights(13, 2, SPEC))
    pub.wait_announced(second, timeout=30)
    assert pub.manifest().version == second
    with pytest.raises(VersionUnavailable, match=rf"version {first} is not held"):
        pub.manifest(first)
