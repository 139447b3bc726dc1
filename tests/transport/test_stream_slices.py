"""Slices on the stream path (issues 29 and 30): a sliced subscriber with ``stream=True``
against a publisher process with ``stream=True``, real sockets.

What must hold: the plan's bytes of every version come over the plain TCP port (not one
slice frame), bit-exact where planned and zeros elsewhere; a corrupt slice fails its
slice sum and comes again over frames, counted; a publisher killed -9 mid-version
stages nothing; a publisher whose stream predates slices serves them over frames (one
token, an ``unsupported`` fallback per version), and a subscriber that does not ask
slices there (as before) never touches the port; bad requests are cut, the field named;
sharded trainer ranks and relays serve slices on their own streams too.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client.stream_source import StreamPicker, StreamSource
from subscriber_ext.transport.staging.chunk_source import SourceSink
from subscriber_ext.transport.staging.request_table import RequestTable
from subscriber_ext.transport.staging.sparse_assembly import SparseAssembly
from tests.transport.data_path_cases import (
    CHUNK,
    SPEC,
    child_stats,
    kill_mid_stream_stages_nothing,
    pace_stream_reads,
    publish,
    start_publisher,
    subscriber,
)
from tests.transport.procs import Child, as_bytes, det_weights, wait_until
from tests.unit.scrape import worker_view
from weightpub.fleet_view import stream_line
from weightpub.status import fetch_status
from weightpub_wire import stream_link
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ProtocolError
from weightpub_wire.slice_plan import from_ranges

pytestmark = pytest.mark.timeout(120)

ROW = 1024 * 4  # bytes of one row of SPEC's "w" (float32 [1024, 1024])
#: "w": the first half of rows 0..511 (2 KiB rows) and the second quarter of rows
#: 512..1023 (1 KiB rows): short rows, gathered by the publisher, landing in scratch at
#: the subscriber and scattered; "b": three 100 kB runs 150 kB apart (sent as views of
#: the snapshot, scatter-read in place); "e" whole (one view, one read)
RANGES = {"w": [(r * ROW, r * ROW + ROW // 2) for r in range(512)]
          + [(r * ROW + ROW // 4, r * ROW + ROW // 2) for r in range(512, 1024)],
          "b": [(i * 150_000, i * 150_000 + 100_000) for i in range(3)],
          "e": [(0, 12_345)]}
PLAN = from_ranges("stream-test", RANGES)
CHUNK0_BYTES = 256 * ROW // 2  # chunk 0 holds rows 0..255 of "w"


def planned_exact(staged: Any, version: int, spec: Any = SPEC,
                  ranges: dict[str, list[tuple[int, int]]] = RANGES) -> bool:
    """``staged`` holds ``version``'s bytes where planned and zeros elsewhere."""
    for name, tensor in det_weights(7, version, spec).items():
        want = torch.zeros_like(as_bytes(tensor))
        for start, end in ranges.get(name, []):
            want[start:end] = as_bytes(tensor)[start:end]
        if not torch.equal(as_bytes(staged.tensors[name]), want):
            return False
    return True


def test_sliced_versions_come_over_the_stream_bit_exact(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, stream=True)
    sub = subscriber(closing, endpoint, stream=True, slice_plan=PLAN)
    for version in (1, 2, 3):
        publish(pub, version)
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.data_path == "stream" and planned_exact(staged, version)
        staged.release()
    status = sub.status()
    assert status["stream"]["fallbacks"] == 0, status["stream"]
    assert status["slice_plan"]["slice_bytes"] == 3 * PLAN.needed_bytes
    assert status["stream"]["bytes_received"] == 3 * PLAN.needed_bytes
    wait_until(lambda: child_stats(pub)["stream"]["slice_bytes_sent"]
               >= 3 * PLAN.needed_bytes, 10, "the publisher to count what it sent")
    stats = child_stats(pub)
    assert stats["stats"]["bytes_sent_slices"] == 0  # not one slice frame
    assert stats["stats"]["bytes_sent_full"] == 0
    stream = stats["stream"]
    assert stream["slice_bytes_sent"] == stream["bytes_sent"] == 3 * PLAN.needed_bytes
    # both forms went: the short rows of "w" gathered, "b" and "e" as views of the snapshot
    assert stream["slice_bytes_gathered"] == 3 * (512 * ROW // 2 + 512 * ROW // 4)
    assert stream["accepted"] == 1 and stream["cut"] == 0
    reply = fetch_status(endpoint).stream  # ``weightpub status`` says the same
    assert reply is not None and (reply.slice_bytes_sent, reply.slice_bytes_gathered) == (
        stream["slice_bytes_sent"], stream["slice_bytes_gathered"])
    assert "slices 5.4 MiB (4.5 gathered)" in str(stream_line(reply))


def test_the_landing_buffer_is_counted_while_held_and_given_back(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The scratch short rows land in is counted in the staging budget each time a slice
    is scattered out of it, and given back once the version is in."""
    pub, endpoint = start_publisher(spawn, stream=True)
    subs: list[WeightSubscriber] = []
    seen: list[tuple[int, int]] = []  # (the stream's scratch, the pool's bytes beside)
    views: list[tuple[dict[str, Any], str]] = []
    place = SparseAssembly.place

    def counted_place(self: SparseAssembly, chunk: int, payload: memoryview) -> int | None:
        seen.append((subs[0].status()["stream"]["scratch_bytes"],
                     subs[0].status()["staging_cache_bytes"]))
        if not views:  # held now, on the worker's status and the replica's /metrics
            views.append(worker_view(subs[0], tmp_path))
        return place(self, chunk, payload)

    monkeypatch.setattr(SparseAssembly, "place", counted_place)
    subs.append(subscriber(closing, endpoint, stream=True, slice_plan=PLAN))
    publish(pub, 1)
    staged = subs[0].wait_for_version(1, timeout=60)
    assert staged.data_path == "stream" and planned_exact(staged, 1)
    staged.release()
    # the short rows of "w" (its four chunks) and "e" (12 KiB, one short piece) landed,
    # each counted while it was there
    assert len(seen) == 5, seen
    assert all(scratch == beside >= CHUNK0_BYTES for scratch, beside in seen), seen
    worker, text = views[0]
    assert worker["stream_scratch_bytes"] == seen[0][0], worker
    assert f'weightpub_stream_scratch_bytes{{rank="0"}} {float(seen[0][0])}' in text
    status = wait_until(lambda: (s := subs[0].status())["stream"]["scratch_bytes"] == 0
                        and s, 10, "the scratch given back")
    assert status["staging_cache_bytes"] == 0 and status["stream"]["landing_refused"] == 0


def test_no_room_to_land_short_rows_reads_them_in_place_bit_exact(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], tmp_path: Path) -> None:
    """A staging budget that holds the plan's pages and not one byte more: the short rows
    are scatter-read in place (counted), the version comes over the stream bit-exact and
    the budget is never passed."""
    pub, endpoint = start_publisher(spawn, stream=True)
    measure = subscriber(closing, endpoint, stream=True, slice_plan=PLAN)
    publish(pub, 1)
    measure.wait_for_version(1, timeout=60).release()
    # the plan's pages, idle in the pool, once the scratch went: the version's staging
    staging = wait_until(lambda: (s := measure.status())["stream"]["scratch_bytes"] == 0
                         and s["staging_bytes"], 10, "the scratch given back")
    measure.close()
    tight = subscriber(closing, endpoint, stream=True, slice_plan=PLAN,
                       staging_budget_bytes=staging)
    staged = tight.wait_for_version(1, timeout=60)
    assert staged.data_path == "stream" and planned_exact(staged, 1)
    status = tight.status()
    assert status["stream"]["fallbacks"] == 0, status["stream"]
    assert status["stream"]["landing_refused"] == 5  # the chunks of short pieces
    assert status["stream"]["scratch_bytes"] == 0
    worker, text = worker_view(tight, tmp_path)  # what the operator reads of it
    assert (worker["stream_landing_refused"], worker["stream_scratch_bytes"]) == (5, 0)
    assert 'weightpub_stream_landing_refused_total{rank="0"} 5.0' in text
    assert 'weightpub_stream_scratch_bytes{rank="0"} 0.0' in text
    assert status["staging_bytes"] == status["staging_budget_bytes"] == staging


def _unit_source() -> tuple[BufferPool, StreamPicker, StreamSource]:
    """A stream source with no connection, its picker on a 1 MiB staging budget."""
    pool = BufferPool(pinned=False, budget_bytes=1 << 20)
    picker = StreamPicker(True, "127.0.0.1", request_timeout=1.0, window_bytes=1 << 20,
                          pool=pool)
    sink = SourceSink(RequestTable(), chunk=lambda *a: None, error=lambda e: None,
                      bad=lambda e: None, discard_rest=lambda *a: None)
    source = picker.source = StreamSource(picker, sink)
    return pool, picker, source


def test_the_scratch_is_shed_when_staging_needs_the_room() -> None:
    """A version that would wait for staging memory takes the stream's scratch back first
    (``BufferPool.on_shed``); scratch past the budget is refused, nothing counted."""
    pool, picker, source = _unit_source()
    assert source._grow(256 << 10) and source._grow(512 << 10)  # grown: the difference held
    assert pool.side_bytes == picker.status()["scratch_bytes"] == 512 << 10
    assert not source._grow(2 << 20) and pool.side_bytes == 512 << 10  # over the budget
    assert pool.room_for(768 << 10)  # staging needs the room: the scratch goes first
    assert source.scratch_bytes == 0 == pool.side_bytes
    picker.close()  # no longer asked to shed
    assert pool.hold(512 << 10) and not pool.room_for(768 << 10)  # nobody gives it back
    assert pool.side_bytes == 512 << 10


def test_stale_bytes_land_in_counted_scratch_or_cost_a_named_fallback() -> None:
    """A reply nobody waits for any more is read into scratch counted in the budget and
    given back once nothing is asked; with no room for it, the connection is dropped
    instead, counted as ``staging_budget``."""
    for room in (True, False):
        pool, picker, source = _unit_source()
        if not room:
            assert pool.hold(1 << 20)  # another holder took the whole budget
        mine, theirs = socket.socketpair()
        with theirs:
            mine.setblocking(False)
            source.sock, source.state = mine, "up"
            stale = 50_000  # bytes of request 7, not in the client's table (fits the pair's buffer)
            theirs.sendall(stream_link.reply_header(stream_link.OK, 7, 1, 0, stale)
                           + bytes(stale))
            source._read()  # every byte is in the kernel already: one look reads them
            if room:
                assert source._reply is None and source.state == "up"  # read and dropped
                assert pool.side_bytes == source.scratch_bytes == stale  # counted, < 1 MiB
                source.tick(0.0)  # nothing asked here: given back
                assert pool.side_bytes == source.scratch_bytes == 0
                assert picker.fallback_causes == {}
            else:
                assert source.sock is None and source.down
                assert picker.fallback_causes == {"staging_budget": 1}
                assert pool.side_bytes == 1 << 20 and source.scratch_bytes == 0
        picker.close()


def test_a_corrupt_slice_fails_its_sum_and_comes_over_frames(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, stream=True, stream_fault="corrupt:0")
    sub = subscriber(closing, endpoint, stream=True, slice_plan=PLAN, request_timeout=20.0)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert planned_exact(staged, 1)  # the bad slice never staged
    assert staged.data_path == "stream+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["stream"]["fallback_causes"] == {"checksum": 1}
    stats = child_stats(pub)["stats"]
    assert stats["bytes_sent_slices"] == CHUNK0_BYTES  # that chunk's slice alone, a frame
    assert stats["bytes_sent_full"] == 0


def test_a_publisher_killed_mid_version_stages_nothing(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pace_stream_reads(monkeypatch)
    rows, row = 4096, 8192
    ranges = {"big": [(r * row, r * row + row // 2) for r in range(rows)]}
    pub, endpoint = start_publisher(spawn, stream=True)
    sub = closing(WeightSubscriber(endpoint, stream=True, request_timeout=2.0,
                                   max_chunk_retries=1, window_bytes=2 * CHUNK,
                                   slice_plan=from_ranges("big", ranges)))
    # 32 MiB, half of every row planned
    kill_mid_stream_stages_nothing(pub, sub, [("big", "uint8", [rows, row])])


def test_old_publisher_new_subscriber_and_the_reverse(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    # a publisher whose stream predates slices: its ACCEPTED has no FLAG_SLICES, so the
    # subscriber sends it no ``slices`` request (it would cut the connection), asks the
    # slices over frames and asks no token for that publisher's later versions
    old, endpoint = start_publisher(spawn, stream=True, stream_fault="old")
    sub = subscriber(closing, endpoint, stream=True, slice_plan=PLAN)
    for version in (1, 2):
        publish(old, version)
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.data_path == "slices" and planned_exact(staged, version)
        staged.release()
    assert sub.status()["stream"]["fallback_causes"] == {"unsupported": 2}
    stats = child_stats(old)
    assert stats["stream"]["tokens_issued"] == 1 and stats["stream"]["cut"] == 0
    assert stats["stats"]["bytes_sent_stream"] == 0
    assert stats["stats"]["bytes_sent_slices"] == 2 * PLAN.needed_bytes

    # a new publisher, a sliced subscriber from before (no stream for slices): frames
    new, endpoint = start_publisher(spawn, stream=True)
    before = subscriber(closing, endpoint, slice_plan=PLAN)
    publish(new, 1)
    staged = before.wait_for_version(1, timeout=60)
    assert staged.data_path == "slices" and planned_exact(staged, 1)
    stats = child_stats(new)
    assert stats["stream"]["accepted"] == 0 and stats["stats"]["bytes_sent_stream"] == 0
    # ... and FLAG_SLICES sits where a subscriber from before read padding
    accepted = stream_link.reply_header(stream_link.ACCEPTED, flags=stream_link.FLAG_SLICES)
    assert struct.unpack("<4sB3xQQII", accepted)[:2] == (b"WPsr", stream_link.ACCEPTED)


def test_slice_requests_are_bounded_and_name_what_is_wrong() -> None:
    blocks = [(0, 512, 1024, 3), (4096, 100, 0, 1)]
    data = stream_link.slice_request(9, 2, [(4, blocks)])
    head = stream_link.parse_request_head(data[:stream_link.REQUEST_BYTES])
    assert (head.req, head.version, head.count, head.slices) == (9, 2, 1, True)
    entry = data[stream_link.REQUEST_BYTES: stream_link.REQUEST_BYTES + 8]
    assert stream_link.parse_slice_chunk(entry, stream_link.MAX_REQUEST_BLOCKS) == (4, 2)
    assert stream_link.parse_blocks(data[stream_link.REQUEST_BYTES + 8:], 2, 4) == blocks
    with pytest.raises(ProtocolError, match="magic"):  # a publisher without slices
        stream_link.parse_request_head(data[:stream_link.REQUEST_BYTES], slices=False)
    with pytest.raises(ProtocolError, match=r"slices\.blocks"):  # refused before reading
        stream_link.parse_slice_chunk(struct.pack("<II", 4, 1 << 20),
                                      stream_link.MAX_REQUEST_BLOCKS)
    with pytest.raises(ProtocolError, match=r"slices\.blocks"):  # past the request's total
        stream_link.parse_slice_chunk(struct.pack("<II", 4, 10), 9)
    with pytest.raises(ProtocolError, match=r"slices\.blocks\[0\] of chunk 4: 3 rows"):
        stream_link.parse_blocks(struct.pack("<IIII", 0, 512, 100, 3), 1, 4)
    with pytest.raises(ProtocolError, match=r"slices\.blocks\[0\].*past"):
        stream_link.parse_blocks(struct.pack("<IIII", 1 << 30, 1, 0, 1), 1, 4)
    with pytest.raises(ProtocolError, match="blocks"):
        stream_link.slice_request(1, 1, [(0, [])])


def _slice_exchange(pub: WeightPublisher, request: bytes, expect: int = 0) -> bytes:
    """Present a token at ``pub``'s stream port, send ``request``; what came back (up to
    ``expect`` bytes, or until the connection is closed)."""
    stream = pub._stream
    assert stream is not None
    token = stream.issue_token()
    assert token is not None
    with socket.create_connection(("127.0.0.1", stream.port), timeout=10) as conn:
        conn.sendall(stream_link.hello(token))
        accepted = stream_link.parse_reply(conn.recv(stream_link.REPLY_BYTES, socket.MSG_WAITALL))
        assert accepted.status == stream_link.ACCEPTED
        assert accepted.flags == (stream_link.FLAG_SLICES if stream.serves_slices else 0)
        conn.sendall(request)
        got = bytearray()
        try:
            while (not expect or len(got) < expect) and (piece := conn.recv(1 << 16)):
                got += piece
        except ConnectionResetError:  # cut with the request unread: closed all the same
            pass
        return bytes(got)


def test_the_server_gathers_what_is_asked_and_cuts_a_bad_request(
        closing: Callable[[Any], Any]) -> None:
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    weights = det_weights(7, 1, SPEC)
    pub.publish(weights, version=1)
    pub.wait_announced(1, timeout=30)
    flat = as_bytes(weights["w"])
    got = _slice_exchange(pub, stream_link.slice_request(5, 1, [(0, [(100, 512, ROW, 3)])]),
                          stream_link.REPLY_BYTES + 1536)
    reply = stream_link.parse_reply(got[:stream_link.REPLY_BYTES])
    assert (reply.status, reply.req, reply.chunk, reply.size) == (stream_link.OK, 5, 0, 1536)
    want = torch.cat([flat[100 + r * ROW: 100 + r * ROW + 512] for r in range(3)])
    assert got[stream_link.REPLY_BYTES:] == bytes(want.numpy())
    assert pub._stream is not None and pub._stream.slice_bytes_gathered == 1536
    # the gather goes once sent (the kernel's copy), on the connection's thread: the reply
    # may be read here before that thread counts it back
    wait_until(lambda: pub._stream is not None and pub._stream.scratch_bytes == 0, 10,
               "the gather counted back once sent")
    # a block past its chunk: the connection is cut, counted, nothing sent
    assert _slice_exchange(pub, stream_link.slice_request(
        6, 1, [(0, [(CHUNK - 10, 20, 0, 1)])])) == b""
    wait_until(lambda: (pub.stream_status() or {}).get("cut") == 1, 10, "the cut counted")
    assert pub._stream is not None
    pub._stream.serves_slices = False  # a publisher from before: the magic is refused
    assert _slice_exchange(pub, stream_link.slice_request(7, 1, [(0, [(0, 8, 0, 1)])])) == b""
    wait_until(lambda: (pub.stream_status() or {}).get("cut") == 2, 10, "the second cut")



def test_sharded_ranks_serve_their_slices_over_their_own_streams(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    """Each trainer rank's part of the plan over that rank's stream port (its token asked
    over the rank's DEALER), in the rank's chunk ids; ranks the plan does not touch are
    never dialled; not one frame from any rank."""
    from tests.transport.test_sharded import SPECS4, _publish, _start_ranks
    from tests.transport.test_slice_fetch import _check_sharded, _sharded_plan

    ranks, ready0 = _start_ranks(spawn, SPECS4, stream=True)
    plan = _sharded_plan()
    sub = subscriber(closing, ready0["announce"], stream=True, slice_plan=plan)
    for version in (1, 2):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=60)
        _check_sharded(staged, version, SPECS4)
        assert staged.data_path == "stream"
        staged.release()
    stream = sub.status()["stream"]
    assert stream["fallbacks"] == 0 and stream["rank_states"] == {0: "up", 1: "up"}, stream
    assert stream["bytes_received"] == 2 * plan.needed_bytes
    parts = [300 * 34, 77 * 40 * 2, 0, 0]  # each rank's part of the plan, per version
    for rank, child in enumerate(ranks):
        wait_until(lambda child=child, rank=rank: child.request("status")["stream"][
            "slice_bytes_sent"] >= 2 * parts[rank], 10, "a rank to count its sends")
        status = child.request("status")
        assert status["slice_bytes_sent"] == status["bytes_sent"] == 0, (rank, status)
        assert status["stream"]["slice_bytes_sent"] == 2 * parts[rank], (rank, status)
        assert status["stream"]["accepted"] == (1 if parts[rank] else 0)


@pytest.mark.parametrize("cut_through", [True, False], ids=["cut-through", "store-forward"])
def test_a_relay_serves_slices_over_its_stream(
        closing: Callable[[Any], Any], cut_through: bool) -> None:
    """A sliced subscriber behind a relay (``stream: true`` both hops): its slices over the
    relay's stream port, whether the relay forwards chunks as they come or whole
    versions; the relay sends not one slice frame."""
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint, "stream": True, "request_timeout": 5.0},
        "cut_through": cut_through,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "stream": True}})))
    sub = subscriber(closing, relay.endpoint, stream=True, slice_plan=PLAN)
    for version in (1, 2):
        pub.publish(det_weights(7, version, SPEC), version=version)
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.data_path == "stream" and planned_exact(staged, version)
        staged.release()
    assert sub.status()["stream"]["fallbacks"] == 0
    wait_until(lambda: (relay.publisher.stream_status() or {}).get("slice_bytes_sent", 0)
               >= 2 * PLAN.needed_bytes, 10, "the relay to count what it sent")
    served = relay.publisher.stream_status()
    assert served is not None and served["slice_bytes_sent"] == 2 * PLAN.needed_bytes
    assert relay.publisher.data_stats()["bytes_sent_slices"] == 0
