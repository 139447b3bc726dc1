"""10,000+ fuzzed messages per socket type (hypothesis): ROUTER requests, SUB messages,
DEALER replies; and 2,000 hellos and requests on the stream port (``stream=True``), each
on a connection of its own. Each fuzzed frame is refused or harmless; afterwards the same
sockets serve a real version bit-exact, the threads live, and memory is bounded.

Frames are drawn from: random bytes, random msgpack values, valid messages with
one field replaced, removed or added (by an independent msgpack encoder), and
truncated valid frames; each drawn frame is followed by byte-level mutations of
it (flips, insertions, deletions, duplicated spans, truncation). Examples are
derandomized so CI runs the same 10,000 every time.
"""

from __future__ import annotations

import queue
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.faults.stream_client import StreamClient
from tests.transport.faults.tools import RawPeer, pack, rss_mib, threads_named
from tests.transport.procs import Spec, det_weights, digests, wait_until
from tests.transport.test_hostile import FakePublisher
from weightpub_wire import chunk_frame, stream_link
from weightpub_wire import protocol as wire

pytestmark = pytest.mark.timeout(300)
EXAMPLES = 10_000  # messages per socket type
BATCH = 25  # messages per hypothesis example: one drawn, the rest its byte-level mutations
FUZZ = settings(max_examples=EXAMPLES // BATCH, deadline=None, database=None,
                derandomize=True, phases=[Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck))
SPEC = [("w", "float32", [64, 64]), ("b", "bfloat16", [33]), ("s", "int64", [])]

# every code point UTF-8 encodes (st.text's default alphabet, the utf-8 codec), named by
# category: the codec form has hypothesis tabulate the codec over all of Unicode first
# (seconds of CPU in each process whose .hypothesis/ has no table yet, as in CI)
CHARS = st.characters(exclude_categories=("Cs",))
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=True) | st.text(CHARS, max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(CHARS, max_size=8),
                                                                 inner, max_size=4),
    max_leaves=12)


def mutations(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Valid message ``base`` with one field replaced, removed, added; or cut short."""
    keys = sorted(base)
    replaced = st.tuples(st.sampled_from(keys), values).map(
        lambda kv: pack({**base, kv[0]: kv[1]}))
    removed = st.sampled_from(keys).map(lambda k: pack({x: v for x, v in base.items() if x != k}))
    added = st.tuples(st.text(CHARS, max_size=8), values).map(
        lambda kv: pack({**base, kv[0]: kv[1]}))
    whole = pack(base)
    truncated = st.integers(0, max(len(whole) - 1, 0)).map(lambda n: whole[:n])
    return replaced | removed | added | truncated


def frames_for(bases: list[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    raw = st.binary(max_size=256)
    packed = values.map(lambda v: msgpack.packb(v, use_bin_type=True))
    return st.one_of(raw, packed, *(mutations(b) for b in bases))


def _flip(frame: bytes, rnd: random.Random) -> bytes:
    """One byte-level mutation: flip, insert, delete, duplicate or truncate."""
    data = bytearray(frame or b"\x00")
    at = rnd.randrange(len(data))
    op = rnd.randrange(5)
    if op == 0:
        data[at] ^= 1 << rnd.randrange(8)
    elif op == 1:
        data[at:at] = rnd.randbytes(rnd.randrange(1, 9))
    elif op == 2:
        del data[at: at + rnd.randrange(1, 9)]
    elif op == 3:
        data[at:at] = data[at: at + rnd.randrange(1, 64)]
    else:
        del data[at:]
    return bytes(data)


def batches(bases: list[dict[str, Any]]) -> st.SearchStrategy[list[bytes]]:
    """``BATCH`` frames: one drawn by hypothesis, the rest byte-level mutations of it
    (driven by hypothesis' own random source, so failures shrink and replay)."""
    return st.tuples(frames_for(bases), st.randoms(use_true_random=False)).map(
        lambda pair: [pair[0], *(_flip(pair[0], pair[1]) for _ in range(BATCH - 1))])


def _counted() -> dict[str, int]:
    return {"router": 0, "sub": 0, "dealer": 0, "stream": 0}


SENT = _counted()


# -- ROUTER: requests to a real publisher ------------------------------------------------------
@pytest.fixture(scope="module")
def router_rig() -> Iterator[dict[str, Any]]:
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=4096, heartbeat_interval=0.2)
    pub.publish(det_weights(1, 1, SPEC))
    pub.wait_announced(1, timeout=30)
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    rig = {"pub": pub, "peer": peer, "rss": rss_mib(), "ctx": ctx}
    yield rig
    peer.close()
    ctx.destroy(linger=0)
    pub.close()


ROUTER_BASES = [
    {"t": "latest", "req": 1},
    {"t": "fetch", "req": 2, "publisher_id": "x", "version": 1, "chunks": [0, 1]},
    {"t": "status", "req": 3},
    {"t": "report", "subscriber_id": "s", "staged_version": 1, "applied_version": 1,
     "last_error": "e", "publisher_id": "x"},
]


@FUZZ
@given(batch=batches(ROUTER_BASES), multipart=st.integers(0, BATCH * 3))
def test_fuzz_router(router_rig: dict[str, Any], batch: list[bytes], multipart: int) -> None:
    sock = router_rig["peer"].sock
    for index, frame in enumerate(batch):
        if index == multipart:  # now and then a message of several frames
            sock.send_multipart([frame, frame[:3], b""])
        else:
            sock.send(frame)
        SENT["router"] += 1
    while sock.poll(0):  # replies to whatever happened to be valid
        sock.recv_multipart()


def test_router_serves_bit_exact_after_the_fuzz(router_rig: dict[str, Any]) -> None:
    assert SENT["router"] >= EXAMPLES
    pub = router_rig["pub"]
    peer = router_rig["peer"]
    peer.send(wire.StatusRequest(req=99))  # answered after everything sent before it

    def status_reply() -> bool:
        reply = wire.decode(peer.recv(timeout=30)[0])
        return isinstance(reply, wire.StatusReply) and reply.req == 99

    wait_until(status_reply, 60, "the status reply", interval=0)
    assert pub._server.is_alive() and pub._server.bad_messages > EXAMPLES // 2
    with WeightSubscriber(pub.endpoint) as sub:
        pub.publish(det_weights(1, 2, SPEC))
        staged = sub.wait_for_version(2, timeout=30)
        assert digests(staged.items()) == digests(det_weights(1, 2, SPEC).items())
    grown = rss_mib() - router_rig["rss"]
    print(f"\nROUTER fuzz: {SENT['router']} frames, {pub._server.bad_messages} refused, "
          f"{len(pub.fleet())} report rows; RSS +{grown:.0f} MiB")
    assert grown < 150


# -- SUB: manifests and heartbeats from a publisher we script ----------------------------------
class SturdyFake(FakePublisher):
    """The hand-written publisher of test_hostile, answering nothing it has no data for."""

    def _serve(self, identity: bytes, body: bytes, *extra: bytes) -> None:
        try:
            super()._serve(identity, body, *extra)
        except (KeyError, TypeError):
            pass


@pytest.fixture(scope="module")
def sub_rig() -> Iterator[dict[str, Any]]:
    ctx = zmq.Context()
    fake = SturdyFake(ctx)
    fake.start()
    fake.latest_manifest = fake.manifest(det_weights(2, 1, SPEC), 1)
    sub = WeightSubscriber(fake.endpoint, request_timeout=0.5, max_chunk_retries=1)
    sub.wait_for_version(1, timeout=30)
    wait_until(lambda: sub._client.sockets.pub_endpoint, 30, "the SUB connection")
    rig = {"fake": fake, "sub": sub, "rss": rss_mib()}
    yield rig
    sub.close()
    fake.stop.set()
    fake.join(5)
    ctx.term()


def _sub_bases(fake: FakePublisher) -> list[dict[str, Any]]:
    manifest = msgpack.unpackb(wire.encode(wire.decode(pack(fake.manifest(
        det_weights(2, 1, SPEC), 1) | {"t": "manifest"}))))
    beat = {"t": "heartbeat", "publisher_id": fake.publisher_id, "started_at": 1.0,
            "latest_version": 1, "sent_at": 2.0, "interval": 1.0}
    return [{k: v for k, v in manifest.items() if k != "p"}, beat]


@pytest.fixture(scope="module")
def sub_frames(sub_rig: dict[str, Any]) -> st.SearchStrategy[list[bytes]]:
    return batches(_sub_bases(sub_rig["fake"]))


@FUZZ
@given(data=st.data())
def test_fuzz_sub(sub_rig: dict[str, Any], sub_frames: st.SearchStrategy[list[bytes]],
                  data: st.DataObject) -> None:
    fake = sub_rig["fake"]
    for frame in data.draw(sub_frames):
        fake.outbox.put(frame)
        SENT["sub"] += 1
    if SENT["sub"] % 500 == 0:  # keep the outbox short: PUB drops what SUB cannot take
        wait_until(fake.outbox.empty, 30, "the fake's outbox to drain")


def test_sub_stages_bit_exact_after_the_fuzz(sub_rig: dict[str, Any]) -> None:
    assert SENT["sub"] >= EXAMPLES
    fake, sub = sub_rig["fake"], sub_rig["sub"]
    wait_until(fake.outbox.empty, 30, "the fuzz to be sent")
    status = sub.status()
    assert sub._thread.is_alive() and status["bad_messages"] > 0
    # nothing fuzzed was ever staged: the only staged version is still the real v1
    assert sub.latest().version == 1
    assert digests(sub.latest().items()) == digests(det_weights(2, 1, SPEC).items())
    real = fake.manifest(det_weights(2, 2 ** 40, SPEC), 2 ** 40)  # above any fuzzed version
    fake.latest_manifest = real

    def staged() -> bool:
        fake.publish_raw(real)
        latest = sub.latest()
        return latest is not None and latest.version == 2 ** 40

    wait_until(staged, 60, "the real next version", interval=0.2)
    assert digests(sub.latest().items()) == digests(det_weights(2, 2 ** 40, SPEC).items())
    grown = rss_mib() - sub_rig["rss"]
    print(f"\nSUB fuzz: {SENT['sub']} frames, {status['bad_messages']} refused, "
          f"{status['ignored_manifests']} foreign manifests ignored; RSS +{grown:.0f} MiB")
    assert grown < 150


# -- DEALER: replies from a ROUTER we script ---------------------------------------------------
class ReplyFuzzer(threading.Thread):
    """A ROUTER that answers with whatever is queued (fuzz), then honestly (``fake``)."""

    def __init__(self, ctx: zmq.Context, honest: SturdyFake) -> None:
        super().__init__(name="test-reply-fuzzer", daemon=True)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.honest = honest
        self.fuzz: queue.Queue[list[bytes]] = queue.Queue()
        self.identity: bytes | None = None
        self.stop = threading.Event()
        self.fuzzing = True

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.router.poll(5):
                    identity, body, *rest = self.router.recv_multipart()
                    self.identity = identity
                    if not self.fuzzing:
                        self._forward(identity, body)
                while self.identity is not None and not self.fuzz.empty():
                    self.router.send_multipart([self.identity, *self.fuzz.get()])
        finally:
            self.router.close()

    def _forward(self, identity: bytes, body: bytes) -> None:
        """Honest answers, from the honest fake's data (its PUB address included)."""
        try:
            request = wire.decode(body)
        except Exception:
            return
        fake = self.honest
        if isinstance(request, wire.LatestRequest):
            reply = {"t": "latest_rep", "req": request.req, "publisher_id": fake.publisher_id,
                     "started_at": 1.0, "pub_endpoint": fake.pub_endpoint,
                     "heartbeat_interval": 1.0, "manifest": fake.latest_manifest}
            self.router.send_multipart([identity, pack(reply)])
        elif isinstance(request, wire.FetchRequest) and request.version in fake.data:
            data = fake.data[request.version]
            size = fake.latest_manifest["chunk_size"]
            for chunk in request.chunks:
                piece = data[chunk * size: (chunk + 1) * size]
                frame = chunk_frame.build(req=request.req, version=request.version,
                                          chunk=chunk, payload=piece)
                self.router.send_multipart([identity, frame])


@pytest.fixture(scope="module")
def dealer_rig() -> Iterator[dict[str, Any]]:
    ctx = zmq.Context()
    honest = SturdyFake(ctx)
    honest.start()
    honest.latest_manifest = honest.manifest(det_weights(3, 1, SPEC), 1)
    fuzzer = ReplyFuzzer(ctx, honest)
    fuzzer.start()
    sub = WeightSubscriber(fuzzer.endpoint, request_timeout=0.5, max_chunk_retries=1)
    wait_until(lambda: fuzzer.identity is not None, 30, "the subscriber's first request")
    rig = {"fuzzer": fuzzer, "honest": honest, "sub": sub, "rss": rss_mib()}
    yield rig
    sub.close()
    fuzzer.stop.set()
    fuzzer.join(5)
    honest.stop.set()
    honest.join(5)
    ctx.term()


DEALER_BASES = [
    {"t": "latest_rep", "req": 1, "publisher_id": "f", "started_at": 1.0,
     "pub_endpoint": "tcp://127.0.0.1:1", "heartbeat_interval": 1.0, "manifest": None},
    {"t": "chunk", "req": 1, "version": 1, "chunk": 0, "size": 4},
    {"t": "error", "req": 1, "code": "bad_request", "message": "m", "version": 1},
]


@FUZZ
@given(batch=batches(DEALER_BASES), payload=st.binary(max_size=64), parts=st.integers(1, 3))
def test_fuzz_dealer(dealer_rig: dict[str, Any], batch: list[bytes], payload: bytes,
                     parts: int) -> None:
    fuzzer = dealer_rig["fuzzer"]
    for frame in batch:
        fuzzer.fuzz.put([frame, payload, payload][:parts])
        SENT["dealer"] += 1
    if SENT["dealer"] % 500 == 0:
        wait_until(fuzzer.fuzz.empty, 30, "the fuzzer's queue to drain")


def test_dealer_stages_bit_exact_after_the_fuzz(dealer_rig: dict[str, Any]) -> None:
    assert SENT["dealer"] >= EXAMPLES
    fuzzer, sub = dealer_rig["fuzzer"], dealer_rig["sub"]
    wait_until(fuzzer.fuzz.empty, 30, "the fuzz to be sent")
    time.sleep(0.5)
    assert sub._thread.is_alive() and sub.status()["bad_messages"] > 0
    assert sub.latest() is None  # nothing fuzzed was ever staged
    fuzzer.fuzzing = False
    staged = sub.wait_for_version(1, timeout=60)
    assert digests(staged.items()) == digests(det_weights(3, 1, SPEC).items())
    grown = rss_mib() - dealer_rig["rss"]
    print(f"\nDEALER fuzz: {SENT['dealer']} replies, {sub.status()['bad_messages']} refused; "
          f"RSS +{grown:.0f} MiB")
    assert grown < 150


# -- the stream port: hellos and requests, each on a connection of its own ---------------------
STREAM_EXAMPLES = 2_000  # a connection and a token each: a fifth of the frames above
CONN = "weightpub-stream-conn"
STREAM_SPEC: Spec = [(name, dtype, tuple(shape)) for name, dtype, shape in SPEC]


@pytest.fixture(scope="module")
def stream_rig() -> Iterator[dict[str, Any]]:
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=4096, heartbeat_interval=0.2,
                          stream=True)
    pub.publish(det_weights(1, 1, STREAM_SPEC), version=1)
    pub.wait_announced(1, timeout=30)
    assert pub._stream is not None
    ctx = zmq.Context()
    yield {"pub": pub, "client": StreamClient(ctx, pub.endpoint, pub._stream.port),
           "rss": rss_mib(), "threads": len(threads_named(CONN))}
    ctx.destroy(linger=0)
    pub.close()


STREAM_BASES = [
    stream_link.request(1, 1, [0, 1]),
    stream_link.request(2, 1, [3, 3, 2]),
    stream_link.request(3, 9, [0]),  # a version never published
    stream_link.slice_request(4, 1, [(0, [(0, 64, 128, 4)]), (2, [(100, 200, 0, 1)])]),
    stream_link.hello(bytes(stream_link.TOKEN_BYTES)),  # a token never issued
]


def stream_batches() -> st.SearchStrategy[list[bytes]]:
    """``BATCH`` byte strings: a valid request (or random bytes), then mutations of it."""
    drawn = st.sampled_from(STREAM_BASES) | st.binary(max_size=64)
    return st.tuples(drawn, st.randoms(use_true_random=False)).map(
        lambda pair: [pair[0], *(_flip(pair[0], pair[1]) for _ in range(BATCH - 1))])


@settings(FUZZ, max_examples=STREAM_EXAMPLES // BATCH)
@given(batch=stream_batches(), as_hello=st.booleans())
def test_fuzz_stream_port(stream_rig: dict[str, Any], batch: list[bytes],
                          as_hello: bool) -> None:
    """Each string on a new connection: after an accepted hello, or in place of the hello.
    Then our side ends; the publisher answers what parsed and closes, or cuts at once:
    reading to the end is bounded by the client's 10 s timeout (a hang fails)."""
    client = stream_rig["client"]
    for data in batch:
        sock = client.connect() if as_hello else client.accepted()
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except TimeoutError:
            raise
        except OSError:
            pass  # cut: reset with our bytes unread, or no longer connected
        finally:
            sock.close()
        SENT["stream"] += 1


def test_stream_port_serves_bit_exact_after_the_fuzz(stream_rig: dict[str, Any]) -> None:
    assert SENT["stream"] >= STREAM_EXAMPLES
    pub = stream_rig["pub"]
    server = pub._stream
    wait_until(lambda: len(threads_named(CONN)) == stream_rig["threads"]
               and server.status()["connections"] == 0, 10, "every fuzzed connection closed")
    status = server.status()
    assert status["cut"] > 0 and status["refused"] > 0, status
    with WeightSubscriber(pub.endpoint, stream=True) as sub:
        pub.publish(det_weights(1, 2, STREAM_SPEC), version=2)
        staged = sub.wait_for_version(2, timeout=30)
        assert staged.data_path == "stream"
        assert digests(staged.items()) == digests(det_weights(1, 2, STREAM_SPEC).items())
    grown = rss_mib() - stream_rig["rss"]
    print(f"\nstream fuzz: {SENT['stream']} connections, {status['cut']} cut, "
          f"{status['refused']} refused; RSS +{grown:.0f} MiB")
    assert grown < 64
