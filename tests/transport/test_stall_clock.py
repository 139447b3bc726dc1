"""The publisher's per-peer stall clock starts when bytes are queued, not when the peer
was last busy.

Why: a peer that connected and then waited (a relay, a replica between versions) for
longer than ``stall_timeout`` was cut on the first pump after its first fetch, before
ZeroMQ could send a frame of it: the fleet benchmark's relays lost their connection to
the trainer on the first version (docs/benchmarks.md, "House third pass: same-run
comparison against 963a4fb"). Real sockets; the table's clock is the server's
(``time.monotonic``), so "connected 100 s ago" is a ``now`` in the past, not a sleep.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from publisher.serving.connection_credit import PeerLimits, PeerTable

pytestmark = pytest.mark.timeout(60)

STALL = 30.0
BODY = 64 << 10
FILLER = 16  # MiB sent past the table first, more than a DEALER that does not read holds


@pytest.fixture
def table() -> Iterator[tuple[PeerTable, bytes]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDBUF, 4096)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.poll(10_000), "the DEALER's first message"
    identity = router.recv_multipart()[0]
    for _ in range(FILLER):  # the path is full: what the table sends next stays queued
        router.send_multipart([identity, bytes(1 << 20)])
    try:
        yield PeerTable(router, PeerLimits(stall_timeout=STALL), None, lambda _v: True), \
            identity
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_peer_idle_past_stall_timeout_is_not_cut_when_it_is_next_served(
    table: tuple[PeerTable, bytes],
) -> None:
    peers, identity = table
    peer = peers.peer(identity, None, time.monotonic() - 3 * STALL)  # connected long ago
    assert peer is not None
    assert peers.reply(peer, bytes(BODY))  # an answer it has not read yet
    peers.pump(time.monotonic())
    assert peers.cut_peers == 0, "cut for the time it spent idle"
    assert peers.queued_bytes(identity) == BODY


def test_a_peer_that_does_not_read_is_still_cut_after_stall_timeout(
    table: tuple[PeerTable, bytes],
) -> None:
    peers, identity = table
    peer = peers.peer(identity, None, time.monotonic())
    assert peer is not None
    assert peers.reply(peer, bytes(BODY))
    peers.pump(time.monotonic() + STALL / 2)
    assert peers.cut_peers == 0
    peers.pump(time.monotonic() + STALL + 1)
    assert peers.cut_peers == 1
    assert peers.queued_bytes(identity) == 0
