"""Peers that try to make the publisher or a subscriber hold memory, time or log lines.

Each attack runs against a real publisher process (RSS read from /proc) or a
real subscriber, then a real version must still arrive bit-exact. The RSS
figures are printed (docs/RELIABILITY.md quotes them).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from publisher import ProtocolError, WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.faults.harness import Proc
from tests.transport.faults.tools import LineCounter, RawPeer, pack, rss_mib
from tests.transport.procs import det_weights, digests, free_port, wait_until
from tests.transport.test_hostile import FakePublisher
from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import parse_endpoint

pytestmark = pytest.mark.timeout(120)
SPEC16 = [("w", "float32", [4096, 1024])]  # 16 MiB in 16 chunks of 1 MiB
SMALL = [("w", "float32", [256, 256])]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _receive_bit_exact(endpoint: str, seed: int, version: int, spec: Any) -> None:
    with WeightSubscriber(endpoint, request_timeout=1.0) as sub:
        staged = sub.wait_for_version(version, timeout=30)
        assert digests(staged.items()) == digests(det_weights(seed, version, spec).items())


def test_a_client_that_never_reads_cannot_pin_versions(ctx: zmq.Context) -> None:
    """The audit: one fetch per version, never read: 492 -> 1,474 MiB over 40 versions of
    16 MiB, and it stayed. Now the peer's queue is credit-bounded and, once it makes no
    progress for ``stall_timeout``, its connection is cut and the versions are freed."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = Proc("publisher", endpoint=endpoint, seed=3, chunk_size=1 << 20, stall_timeout=2.0,
               exact_rss=True)
    try:
        pub.publish(1, SMALL)
        base = rss_mib(pub.pid)
        hostile = RawPeer(ctx, endpoint, rcvhwm=1)
        peak = base
        for version in range(2, 42):
            pub.publish(version, SPEC16)
            hostile.send(wire.FetchRequest(req=1, publisher_id=pub.publisher_id,  # same id
                                           version=version, chunks=tuple(range(16))))
            peak = max(peak, rss_mib(pub.pid))
        time.sleep(3.0)  # past the stall timeout: the peer is cut, its frames freed
        settled = rss_mib(pub.pid)
        _receive_bit_exact(endpoint, 3, 41, SPEC16)
        print(f"\nnever-reading client, 40 versions x 16 MiB: publisher RSS {base:.0f} MiB, "
              f"peak {peak:.0f}, after the cut {settled:.0f} (audit: 492 -> 1,474, stayed)")
        assert peak - base < 450, (base, peak)
        assert settled - base < 150, (base, settled)
        hostile.close()
    finally:
        pub.close()


def _zmtp_null_dealer(port: int) -> socket.socket:
    """A raw ZMTP 3.0 client (NULL mechanism) that speaks just enough to send frames."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\x00"
                 + b"\0" * 31)
    sock.recv(64)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    return sock


@pytest.mark.parametrize("target", ["router", "pub"])
def test_a_multipart_message_that_never_ends_is_cut(target: str) -> None:
    """The audit: 400 frames of 1 MiB with MORE set grew the publisher 260 -> 650 MiB."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = Proc("publisher", endpoint=endpoint, seed=4, exact_rss=True)
    try:
        pub.publish(1, SMALL)
        base = peak = rss_mib(pub.pid)
        status = None
        port = parse_endpoint(endpoint).port
        if target == "pub":
            with WeightSubscriber(endpoint) as probe:  # learn the PUB port it announces
                probe.wait_for_version(1, timeout=30)
                port = parse_endpoint(probe._client.sockets.pub_endpoint).port
        assert port is not None
        raw = _zmtp_null_dealer(port)
        # frames under each socket's MAXMSGSIZE (64 KiB ROUTER, 4 KiB PUB), MORE always set:
        # ZeroMQ accepts each one and would keep them all until the message ends
        size = 32 << 10 if target == "router" else 2 << 10
        frame = b"\x03" + struct.pack(">Q", size) + b"x" * size
        sent = 0
        try:
            while sent < 400 << 20:
                raw.sendall(frame * 32)
                sent += 32 * size
                peak = max(peak, rss_mib(pub.pid))
        except OSError as exc:  # the publisher cut the connection
            status = type(exc).__name__
        finally:
            raw.close()
        time.sleep(0.5)
        pub.publish(2, SMALL)
        _receive_bit_exact(endpoint, 4, 2, SMALL)
        print(f"\nnever-ending multipart to {target}: {sent >> 20} MiB in {size >> 10} KiB "
              f"frames sent before the cut "
              f"({status}); publisher RSS {base:.0f} -> peak {peak:.0f} MiB "
              "(audit: 260 -> 650)")
        assert status is not None and sent < 400 << 20
        assert peak - base < 80, (base, peak)
    finally:
        pub.close()


def test_decoding_refuses_before_building_objects() -> None:
    """The audit: an 8 MiB request of empty arrays cost 5.3 s and ~73x its size. msgspec
    refuses a frame at its first wrong type; the ROUTER refuses frames over 64 KiB."""
    bombs = {"empty arrays": b"\x90" * (8 << 20),
             "nested arrays": b"\x91" * (8 << 20),
             "a map of arrays": b"\xdf\x00\x80\x00\x00" + b"\x90\x90" * (4 << 20),
             "a fetch with 1M chunk ids": pack({"t": "fetch", "req": 1, "publisher_id": "p",
                                               "version": 1, "chunks": [0] * (1 << 20)})}
    for name, frame in bombs.items():
        tracemalloc.start()
        start = time.perf_counter()
        with pytest.raises(ProtocolError):
            wire.decode(frame, expect=(wire.LatestRequest, wire.FetchRequest,
                                       wire.StatusRequest, wire.Report))
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"\n{name}: {len(frame) >> 20} MiB refused in {seconds * 1000:.2f} ms, "
              f"peak {peak / len(frame):.3f}x its size")
        assert peak < len(frame), (name, peak)  # nothing near 73x is ever built


@pytest.fixture
def lines() -> Iterator[LineCounter]:
    with LineCounter() as counter:
        yield counter


def test_floods_cost_a_few_log_lines_and_do_not_stall_versions(
    ctx: zmq.Context, lines: LineCounter,
) -> None:
    """The audit: one WARNING per bad frame (423,000 lines in 25 s) and the next version
    took 5.3 s instead of 0.17 s during a flood."""
    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub, \
            WeightSubscriber(pub.endpoint) as sub:
        weights = det_weights(7, 1, SPEC16)
        start = time.monotonic()
        pub.publish(weights)
        sub.wait_for_version(1, timeout=30)
        quiet = time.monotonic() - start
        stop = threading.Event()
        bomb = b"\x90" * (60 << 10)  # just under the request size limit

        def flood() -> None:
            peers = [RawPeer(ctx, pub.endpoint) for _ in range(3)]
            try:
                while not stop.is_set():
                    for i, peer in enumerate(peers):
                        peer.send(bomb if i == 0 else b"\xc1garbage")
            finally:
                for peer in peers:
                    peer.close()

        flooders = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        for thread in flooders:
            thread.start()
        wait_until(lambda: pub._server.bad_messages > 20_000, 60, "a flood")
        start = time.monotonic()
        for version in (2, 3):
            pub.publish(det_weights(7, version, SPEC16))
            staged = sub.wait_for_version(version, timeout=60)
        loaded = time.monotonic() - start
        stop.set()
        for thread in flooders:
            thread.join(10)
        assert digests(staged.items()) == digests(det_weights(7, 3, SPEC16).items())
        bad = pub._server.bad_messages
    print(f"\nflood: {bad} bad frames, {lines.lines} log lines; 16 MiB version in "
          f"{quiet:.2f}s quiet vs {loaded / 2:.2f}s per version during the flood")
    assert bad > 20_000 and lines.lines < 60, lines.warnings[-5:]


def test_a_flood_on_sub_is_drained_in_bounded_steps(
    make_sub: Any, lines: LineCounter,
) -> None:
    """Garbage and foreign manifests on the PUB socket: counted, rate-limited, and the
    real version (from the ROUTER) still arrives."""
    ctx = zmq.Context()
    fake = FakePublisher(ctx)
    fake.start()
    try:
        weights = det_weights(9, 1, SMALL)
        fake.latest_manifest = fake.manifest(weights, 1)
        sub = make_sub(fake.endpoint, request_timeout=1.0)
        wait_until(lambda: sub._client.sockets.pub_endpoint, 30, "the SUB connection")
        foreign = dict(fake.manifest(det_weights(9, 2, SMALL), 2), publisher_id="intruder",
                       started_at=time.time() + 3600)  # 'newer' by any clock
        for _ in range(20_000):
            fake.outbox.put(b"\xc1" if _ % 2 else pack({"t": "manifest", **foreign}))
        staged = sub.wait_for_version(1, timeout=30)
        assert digests(staged.items()) == digests(weights.items())
        wait_until(lambda: sub.status()["ignored_manifests"] > 100, 30, "the flood to arrive")
        assert sub.status()["publisher_id"] == fake.publisher_id  # never captured
        wait_until(lambda: fake.outbox.empty(), 30, "the flood to be sent")
        time.sleep(0.5)
        fake.outbox.put(pack({"t": "manifest", **foreign}))  # the last word: a foreign one
        wait_until(lambda: "ignored manifest v2 of publisher instance intruder"
                   in (sub.status()["last_error"] or ""), 30, "last_error to name it")
        status = sub.status()
        print(f"\nSUB flood: {status['bad_messages']} bad, {status['ignored_manifests']} "
              f"foreign manifests ignored; {lines.lines} log lines")
        assert lines.lines < 60, lines.warnings[-5:]
        assert sub.latest().version == 1 and sub.latest().publisher_id == fake.publisher_id
    finally:
        fake.stop.set()
        fake.join(5)
        ctx.term()
