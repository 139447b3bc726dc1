"""A peer serves chunks straight from its staging buffer, and the buffer waits for it.

Real ROUTER/DEALER sockets and a real ``BufferPool``; ``inproc://`` where the test
must see the very memory ZeroMQ sends (inproc hands the message itself to the
receiver: a byte written into staging after the send shows up in what the receiver
reads, which a copy would hide), TCP where a stalled reader must be cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from subscriber_ext.transport.peers.peer_server import PeerServer, PeerServerLimits, Served
from subscriber_ext.transport.peers.upload_budget import UploadBudget
from tests.transport.procs import wait_until
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool, byte_view

pytestmark = pytest.mark.timeout(60)

CHUNK = 1 << 20


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _staged(pool: BufferPool, chunks: int) -> tuple[torch.Tensor, memoryview]:
    buffer = pool.take(chunks * CHUNK)
    buffer.copy_(torch.arange(chunks * CHUNK, dtype=torch.int64).to(torch.uint8))
    return buffer, byte_view(buffer)


def _server(router: zmq.Socket, pool: BufferPool, buffer: torch.Tensor, view: memoryview,
            limits: PeerServerLimits | None = None) -> PeerServer:
    def lookup(publisher_id: str, version: int, chunk: int) -> Served:
        return Served(view[chunk * CHUNK: (chunk + 1) * CHUNK], buffer)

    return PeerServer(router, lookup, UploadBudget(None, None), limits or PeerServerLimits(),
                      sends=pool)


def _ask(dealer: zmq.Socket, server: PeerServer, chunks: tuple[int, ...]) -> None:
    dealer.send(wire.encode(wire.FetchRequest(req=1, publisher_id="pub", version=1,
                                              chunks=chunks)))
    wait_until(lambda: server.router.poll(10) != 0, 10, "the request")
    server.on_readable(time.monotonic())
    server.pump(time.monotonic())


def _pump_until(server: PeerServer, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, f"{what} within 20s"
        server.pump(time.monotonic())
        time.sleep(0.01)


def _pair(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    router.bind(f"inproc://{name}")
    dealer.connect(f"inproc://{name}")
    return router, dealer


def test_a_peer_sends_its_staging_bytes_themselves_no_copy(ctx: zmq.Context) -> None:
    pool = BufferPool(max_buffers=2, pinned=False)
    buffer, view = _staged(pool, 2)
    router, dealer = _pair(ctx, "zero-copy")
    server = _server(router, pool, buffer, view)
    _ask(dealer, server, (1,))
    assert server.payload_bytes_sent == CHUNK and pool.sends_in_flight == 1
    header = chunk_frame.parse(dealer.recv())
    assert header == chunk_frame.ChunkHeader(req=1, version=1, chunk=1, size=CHUNK,
                                             follows=True)
    expected = bytearray(view[CHUNK: 2 * CHUNK])
    # written after the send, before the receiver read it: only the staging memory itself
    # carries this byte to the receiver (a copy taken at send time would not)
    view[CHUNK + 12345] ^= 0xFF
    expected[12345] ^= 0xFF
    payload = dealer.recv()
    assert payload == bytes(expected)
    _pump_until(server, lambda: pool.sends_in_flight == 0, "ZeroMQ letting go of the payload")
    assert server.stats()["queued_bytes"] == 0


def test_a_staging_buffer_is_not_reused_while_a_peer_send_is_pending(
        ctx: zmq.Context) -> None:
    pool = BufferPool(max_buffers=2, pinned=False, budget_bytes=2 * CHUNK)
    buffer, view = _staged(pool, 2)
    key = buffer.data_ptr()
    router, dealer = _pair(ctx, "drain")
    server = _server(router, pool, buffer, view)
    _ask(dealer, server, (0,))
    assert pool.sends_in_flight == 1
    pool.give(buffer)  # the version is over while the receiver has not read the payload
    assert pool.draining(key) and pool.held_bytes == 2 * CHUNK  # counted once, not freed
    assert not pool.room_for(2 * CHUNK)  # a new version waits: no reuse, no second buffer
    assert chunk_frame.parse(dealer.recv()).chunk == 0
    assert dealer.recv() == bytes(view[:CHUNK])  # the stalled receiver reads at last
    _pump_until(server, lambda: not pool.draining(key), "the buffer drained")
    assert pool.room_for(2 * CHUNK) and pool.take(2 * CHUNK).data_ptr() == key  # reused
    assert pool.held_bytes == 2 * CHUNK


def test_a_reader_that_stops_reading_is_cut_so_the_buffer_can_be_reused(
        ctx: zmq.Context) -> None:
    chunks = 16
    pool = BufferPool(max_buffers=2, pinned=False, budget_bytes=chunks * CHUNK)
    buffer, view = _staged(pool, chunks)
    key = buffer.data_ptr()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDBUF, 64 << 10)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 64 << 10)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    limits = PeerServerLimits(max_queued_chunks=chunks, drain_grace=0.3, stall_timeout=30.0)
    server = _server(router, pool, buffer, view, limits)
    _ask(dealer, server, tuple(range(chunks)))  # and never read
    _pump_until(server, lambda: server.chunks_served == chunks, "every chunk handed over")
    time.sleep(0.5)
    server.pump(time.monotonic())
    assert pool.sends_in_flight > 0  # the kernel's buffers cannot hold 16 MiB
    assert server.cut_clients == 0  # stalled, but nobody needs its buffer yet
    pool.give(buffer)
    assert pool.draining(key)
    _pump_until(server, lambda: server.cut_clients == 1, "the stalled reader cut")
    _pump_until(server, lambda: not pool.draining(key), "the buffer drained after the cut")
    assert pool.sends_in_flight == 0 and pool.room_for(chunks * CHUNK)
    assert server.dropped_clients == 1 and server.bad_requests >= 1


class _Recording:
    """An allocator that records which buffers the pool dropped (unmapped, for memfd)."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(self, key: int) -> None:
        self.freed.append(key)


def test_a_buffer_forgotten_or_dropped_while_sent_is_counted_and_kept_until_the_send_ends(
) -> None:
    allocator = _Recording()
    pool = BufferPool(max_buffers=0, pinned=False, allocator=allocator, budget_bytes=CHUNK)
    buffer = pool.take(CHUNK)
    key = pool.send_begin(buffer[10:20])  # a view: counted on its whole allocation
    assert key == buffer.data_ptr()
    pool.forget(key)  # its version was dropped without a release
    assert pool.draining(key) and pool.held_bytes == pool.draining_bytes == CHUNK
    assert allocator.freed == [] and not pool.room_for(1)  # neither freed nor counted twice
    pool.send_end(key)
    assert allocator.freed == [key] and pool.held_bytes == 0 and pool.room_for(CHUNK)

    second = pool.take(CHUNK)
    key = pool.send_begin(second)
    pool.give(second)  # no room to keep it (max_buffers 0): dropped, once drained
    assert allocator.freed == [buffer.data_ptr()] and pool.draining(key)
    pool.send_end(key)
    assert allocator.freed[-1] == key and pool.held_bytes == 0 and pool.sends_in_flight == 0
