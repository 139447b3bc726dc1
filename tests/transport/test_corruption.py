"""A man in the middle flips one byte of one chunk: the subscriber notices and refetches."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import zmq

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import InlineChunks, as_bytes, det_weights, wait_until
from weightpub_wire import chunk_frame

pytestmark = pytest.mark.timeout(60)

SPEC = [("w", "float32", [256, 1000]), ("b", "float16", [3333]), ("i", "int32", [17, 19])]


class CorruptingProxy(threading.Thread):
    """ROUTER (for one subscriber) <-> DEALER (to the publisher's ROUTER).

    Strips/re-adds the subscriber's identity so the publisher sees plain 2-frame
    requests, and flips one byte in the data frame of the ``nth`` chunk reply, once.
    """

    def __init__(self, ctx: zmq.Context, upstream: str, nth: int = 3,
                 always: bool = False) -> None:
        super().__init__(name="test-mitm", daemon=True)
        self.frontend = ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.bind("tcp://127.0.0.1:0")
        self.endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = ctx.socket(zmq.DEALER)
        self.inline = InlineChunks()  # header + payload messages -> one frame to spoil
        self.backend.setsockopt(zmq.LINGER, 0)
        self.backend.connect(upstream)
        self.nth = nth
        self.always = always  # corrupt every chunk, so a version can never verify
        self.corrupted = 0
        self.chunks_seen = 0
        self.flipped: tuple[int, int] | None = None  # (version, chunk)
        self.forwarded = 0
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        client: bytes | None = None
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(50))
                if self.frontend in events:
                    client, *body = self.frontend.recv_multipart()
                    self.backend.send_multipart(body)
                    self.forwarded += 1
                if self.backend in events:
                    joined = self.inline.feed(self.backend.recv_multipart())
                    if client is None or joined is None:
                        continue
                    frames = joined
                    self._maybe_corrupt(frames)
                    self.frontend.send_multipart([client, *frames])
        finally:
            self.frontend.close()
            self.backend.close()

    def _maybe_corrupt(self, frames: list[bytes]) -> None:
        if (self.flipped is not None and not self.always) or len(frames) != 1 \
                or not chunk_frame.is_chunk(frames[0]):
            return
        header = chunk_frame.parse(frames[0])
        self.chunks_seen += 1
        if (self.always or self.chunks_seen == self.nth) and header.size:
            self.corrupted += 1
            data = bytearray(frames[0])
            data[chunk_frame.HEADER_BYTES + header.size // 2] ^= 0x40
            frames[0] = bytes(data)
            self.flipped = (header.version, header.chunk)


def test_flipped_byte_is_detected_and_refetched(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    ctx = zmq.Context()
    pub = make_pub(chunk_size=64 << 10)
    proxy = CorruptingProxy(ctx, pub.endpoint, nth=3)
    proxy.start()
    try:
        weights = det_weights(11, 1, SPEC)
        expected = {k: v.clone() for k, v in weights.items()}
        version = pub.publish(weights)
        sub = make_sub(proxy.endpoint, chunks_per_request=2)
        staged = sub.wait_for_version(version, timeout=30)

        assert proxy.flipped is not None and proxy.flipped[0] == version
        status = sub.status()
        assert status["checksum_failures"] >= 1, status
        assert "checksum mismatch" in (status["last_error"] or ""), status
        for name, want in expected.items():
            assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want)), name
        # only the one flipped chunk failed; its refetch (not corrupted again) passed
        assert status["checksum_failures"] == 1
    finally:
        proxy.stop.set()
        proxy.join(timeout=5)
        assert not proxy.is_alive()
        ctx.term()


def test_a_chunk_that_keeps_failing_ends_as_checksum_error(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    ctx = zmq.Context()
    pub = make_pub(chunk_size=64 << 10)
    proxy = CorruptingProxy(ctx, pub.endpoint, always=True)
    proxy.start()
    try:
        version = pub.publish(det_weights(11, 2, SPEC))
        sub = make_sub(proxy.endpoint, max_chunk_retries=2, request_timeout=1.0)
        wait_until(lambda: "failed its checksum" in (sub.status()["last_error"] or ""), 30,
                   "the version to be given up")
        status = sub.status()
        assert status["last_error"].startswith("ChecksumError: "), status
        assert f"of version {version} failed its checksum 3 times" in status["last_error"]
        assert sub.latest() is None and status["staged_version"] == 0
        assert proxy.corrupted >= 3
    finally:
        proxy.stop.set()
        proxy.join(timeout=5)
        ctx.term()
