"""Sliced members over the peer stream (``docs/peer-stream.md``, slices): a member with a
``slice_plan`` and ``stream=True`` serves its plan's slices on its stream port and asks
its peers' there as ``slices`` requests; real processes and sockets.

Members are ``peer_procs`` children (``slice_rank``: ``test_slice_fetch.half_plan``),
each staged version checked in the child on its planned bytes (zeros elsewhere); with
``peer_fanout=1`` two members of one plan form a chain (slot 1 from slot 0).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from publisher import WeightPublisher
from tests.transport.procs import Child, det_weights
from tests.transport.test_peer_slices import CHUNK, SEED, members, staged_ok, status
from tests.transport.test_peer_stream import _metrics, _read
from tests.transport.test_peers import peer_dealer
from tests.transport.test_slice_fetch import SPEC, half_plan
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link
from weightpub_wire.slice_layout import SliceLayout
from weightpub_wire.stream_port import slice_parts

pytestmark = pytest.mark.timeout(120)


def _options(stream: bool = True) -> dict[str, Any]:
    return {"options": {"stream": stream, "request_timeout": 10.0, "report_interval": 0.3}}


def _publish(pub: WeightPublisher, chain: list[Child], versions: tuple[int, ...]) -> None:
    for version in versions:
        pub.publish(det_weights(SEED, version, SPEC),  # type: ignore[arg-type]
                    version=version)
        for child in chain:
            assert staged_ok(child, version)["data_path"] == "slices"


def _blocks(layout: SliceLayout, manifest: wire.Manifest, chunk: int) -> list[stream_link.Block]:
    low = manifest.chunk_span(chunk)[0]
    return [(start - low, length, stride, rows)
            for start, length, stride, rows in layout.blocks[chunk]]


def test_a_chain_of_two_sliced_members_shares_slices_over_the_stream_bit_exact(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        tmp_path: Path) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = members(spawn, pub, [0, 0], lambda i: _options())
    needed = half_plan(0, SPEC).needed_bytes
    _publish(pub, [first, second], (1, 2))
    asker, server = status(second)["peers"], status(first)["peers"]
    served = server["stream_served"]
    assert not asker["stream_fallback_causes"], asker
    assert asker["stream_bytes_from_peers"] == 2 * needed, asker  # every planned byte
    assert asker["bytes_from_peers"] == 2 * needed
    assert server["served_slices"] == 0  # not one slice as a frame
    assert served["stream_slices"] and served["stream_tokens_issued"] == 1, served
    assert served["stream_slice_bytes_sent"] == served["stream_bytes_sent"] == 2 * needed
    # half rows of 1-2 KiB: gathered, as the publisher gathers them
    assert 0 < served["stream_slice_bytes_gathered"] <= 2 * needed, served
    assert served["stream_scratch_bytes"] == 0  # every gathered copy went with its send
    assert status(second)["slice_plan"]["slice_bytes"] == 2 * needed
    assert pub.data_stats()["bytes_sent_slices"] == 2 * needed  # one plan per version
    metrics = _metrics(first, tmp_path)  # on the replica's /metrics, as the worker writes it
    assert metrics["weightpub_peer_stream_slice_sent_bytes_total"] == 2 * needed
    assert metrics["weightpub_peer_stream_slice_gathered_bytes_total"] == \
        served["stream_slice_bytes_gathered"]

    # the first member's port, asked as a peer would: the plan's bytes are the
    # publisher's, bit for bit; another plan's blocks are UNAVAILABLE at once
    manifest = pub.manifest(2)
    layout = SliceLayout.build(half_plan(0, SPEC), manifest)
    other = SliceLayout.build(half_plan(1, SPEC), manifest)
    chunk = next(c for c in layout.chunks if _blocks(layout, manifest, c)
                 != _blocks(other, manifest, c) and c in other.sizes)
    endpoint = server["endpoint"]
    with peer_dealer(endpoint, b"", None) as dealer:
        dealer.send(wire.encode(stream_link.PeerStreamRequest(
            req=7, publisher_id=manifest.publisher_id)))
        assert dealer.poll(20_000)
        token = wire.decode_as(dealer.recv(), stream_link.StreamToken)
    host = endpoint.split("//")[1].rsplit(":", 1)[0]
    with socket.create_connection((host, token.port), timeout=10) as conn:
        conn.sendall(stream_link.hello(token.token))
        accepted = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
        assert accepted.status == stream_link.ACCEPTED
        assert accepted.flags & stream_link.FLAG_SLICES
        blocks = _blocks(layout, manifest, chunk)
        conn.sendall(stream_link.slice_request(1, 2, [(chunk, blocks)]))
        reply = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
        assert (reply.status, reply.chunk, reply.size) == (stream_link.OK, chunk,
                                                            layout.sizes[chunk])
        held = pub._store.get(2)
        assert held is not None
        want = b"".join(bytes(p) for p in slice_parts(
            held.chunk_view(chunk), blocks)[0])  # what the publisher sends
        assert _read(conn, reply.size) == want
        conn.sendall(stream_link.slice_request(2, 2, [(chunk, _blocks(other, manifest, chunk))]))
        reply = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
        assert (reply.status, reply.req, reply.chunk) == (stream_link.UNAVAILABLE, 2, chunk)
        conn.sendall(stream_link.request(3, 2, [chunk]))  # a whole chunk it does not hold
        reply = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
        assert (reply.status, reply.req) == (stream_link.UNAVAILABLE, 3)
    assert status(first)["peers"]["stream_served"]["stream_unavailable"] == 2


@pytest.mark.parametrize("peer", ["off", "unsliced"])
def test_a_peer_serving_no_slices_on_its_stream_costs_a_counted_fallback_to_frames(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
        peer: str) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = members(spawn, pub, [0, 0], lambda i: {
        **_options(stream=i == 1 or peer == "unsliced"),
        **({"stream_unsliced": True} if i == 0 and peer == "unsliced" else {})})
    needed = half_plan(0, SPEC).needed_bytes
    _publish(pub, [first, second], (1, 2))
    asker, server = status(second)["peers"], status(first)["peers"]
    assert asker["stream_bytes_from_peers"] == 0, asker
    assert asker["bytes_from_peers"] >= needed  # as slice frames, from its peer
    assert server["served_slices"] > 0
    causes = asker["stream_fallback_causes"]
    if peer == "off":  # asked once, told why not (QUIET_S)
        assert causes == {"refused": 1}, asker
        assert "the peer stream is off here" in asker["stream_last_error"]
        assert server["stream_served"] is None
    else:  # connected, no FLAG_SLICES: each version's slices over frames, counted
        assert set(causes) == {"unsupported"} and causes["unsupported"] >= 1, asker
        assert "does not serve slices" in asker["stream_last_error"]
        assert "peer" in asker["stream_last_error"]
        assert server["stream_served"]["stream_tokens_issued"] == 1


def test_a_slice_the_peer_answers_unavailable_on_its_stream_comes_from_elsewhere(
        make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child]) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)
    first, second = members(spawn, pub, [0, 0], lambda i: {
        **_options(), **({"stream_gone": True} if i == 0 else {})})
    needed = half_plan(0, SPEC).needed_bytes
    _publish(pub, [first, second], (1, 2))  # bit-exact all the same
    asker, server = status(second)["peers"], status(first)["peers"]
    # chunk 0 (and the rest of its request) answered UNAVAILABLE at once, each version
    assert server["stream_served"]["stream_unavailable"] >= 2, server["stream_served"]
    assert server["served_slices"] >= 2  # then asked elsewhere: that peer's frames
    assert not asker["stream_fallback_causes"], asker  # not a failure of the stream
    assert asker["bytes_from_peers"] == 2 * needed  # nothing more from the publisher
    assert pub.data_stats()["bytes_sent_slices"] == 2 * needed
    assert status(second)["checksum_failures"] == 0


@pytest.mark.parametrize("room", [True, False])
def test_the_port_gathers_short_rows_in_the_budget_or_sends_them_row_by_row(room: bool) -> None:
    """The port alone (no processes): a slice of 1 KiB rows 4 KiB apart and a run. With
    room the rows are one gathered copy, counted in the pool until sent; without, a view
    per row; the same bytes either way."""
    import time

    import torch

    from subscriber_ext.transport.peers.peer_server import GONE, PeerServerLimits, Served
    from subscriber_ext.transport.peers.peer_stream_server import PeerStreamServer
    from subscriber_ext.transport.peers.upload_budget import UploadBudget
    from tests.transport.procs import wait_until
    from weightpub_wire.buffers import BufferPool, byte_view

    mib = 1 << 20
    blocks = [(0, 1024, 4096, 128), (mib // 2, 4096, 4096, 16)]
    pool = BufferPool(max_buffers=1, pinned=False,
                      budget_bytes=mib + (mib if room else 1024))
    buffer = pool.take(mib)
    buffer.copy_(torch.arange(mib, dtype=torch.int64).to(torch.uint8))
    view = byte_view(buffer)

    def slices(publisher_id: str, version: int, chunk: int, asked: Any) -> Any:
        return Served(view, buffer) if asked == blocks else GONE

    server = PeerStreamServer("127.0.0.1", lambda *_: GONE, UploadBudget(None, None),
                              PeerServerLimits(), sends=pool, slice_lookup=slices,
                              scratch=pool)
    try:
        token = server.issue_token(None, "pub")
        assert token is not None
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(stream_link.hello(token))
            accepted = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
            assert accepted.flags & stream_link.FLAG_SLICES
            conn.sendall(stream_link.slice_request(1, 1, [(0, blocks)]))
            wait_until(lambda: (server.pump(time.monotonic()) or True)
                       and server.stats()["stream_chunks_sent"] == 1, 20, "the slice sent")
            reply = stream_link.parse_reply(_read(conn, stream_link.REPLY_BYTES))
            want = b"".join(bytes(view[s + r * stride: s + r * stride + n])
                            for s, n, stride, rows in blocks for r in range(rows))
            assert reply.size == len(want) and _read(conn, reply.size) == want
        stats = server.stats()
        assert stats["stream_slice_bytes_gathered"] == (128 * 1024 if room else 0), stats
        assert stats["stream_gather_refused"] == (0 if room else 1)
        assert stats["stream_scratch_bytes"] == 0 and pool.side_bytes == 0  # given back
    finally:
        server.close()
        pool.give(buffer)
