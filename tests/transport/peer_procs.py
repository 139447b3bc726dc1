"""Child side of the peer-sharing tests: one ``peer_share=True`` subscriber process.

Run through ``tests.transport.procs`` (role ``peer``). It reports every staged
version (digests per tensor, checked against ``det_weights``) and answers
``status``. ``corrupt: true`` makes its peer server flip a byte of every chunk it
serves (a peer gone bad: its own staging stays correct, what it sends is not).
``stall: true`` makes it read every request and answer none (a sybil: it says hello,
stays connected and answers ZMTP heartbeats, so nothing but silence gives it away;
a SIGSTOP'd member instead loses its connections to heartbeats within seconds and
leaves the plan at ``member_ttl``); its status then counts the requests it swallowed.
``stream_corrupt: true`` does the same to what its stream port sends (peers over the
stream); ``stream_corrupt: "short"`` sends each chunk less its last byte there.
``stream_unsliced: true`` makes its stream port serve no ``slices`` (as a port from
before them: no ``FLAG_SLICES`` in its ``ACCEPTED``).
``stream_gone: true`` makes its stream port answer chunk 0's slices ``UNAVAILABLE`` (as
for a slice outside its plan; its frames still serve it).
``slice_rank: r`` makes it a sliced member (issue 30): ``test_slice_fetch.half_plan(r,
spec)``, each staged version checked on its planned bytes only (``assert_planned``).
"""

from __future__ import annotations

import os
import queue
from typing import Any

from tests.transport.procs import _commands, _emit, det_weights, digests


def _corrupt_what_it_serves() -> None:
    from subscriber_ext.transport.peers import peer_server

    original = peer_server.PeerServer._send_chunk

    def send_chunk(self: Any, client: Any, ask: Any, found: Any) -> bool:
        bad = bytearray(found.data)  # a copy of its own: the staging stays correct
        # (a slice is a gathered copy already)
        bad[len(bad) // 2] ^= 0xFF
        return bool(original(self, client, ask, peer_server.Served(memoryview(bad), None)))

    peer_server.PeerServer._send_chunk = send_chunk  # type: ignore[method-assign]


def _corrupt_what_it_streams(short: bool = False) -> None:
    """Its stream port flips a byte of every chunk it hands over (a copy: the staging
    stays correct, and the buffer's count ends as it would); ``short``: sends each chunk
    but its last byte instead (a reply shorter than the chunk)."""
    from subscriber_ext.transport.peers import peer_stream_server

    original = peer_stream_server.PeerStreamServer._hand

    def hand(self: Any, job: Any, chunk: int, payload: Any, key: Any, gathered: int,
             last: bool = False) -> bool:
        if payload is not None:
            bad = bytearray(b"".join(bytes(part) for part in payload))
            if short:
                del bad[-1]
            else:
                bad[len(bad) // 2] ^= 0xFF
            payload = [memoryview(bad)]
        return bool(original(self, job, chunk, payload, key, gathered, last))

    peer_stream_server.PeerStreamServer._hand = hand  # type: ignore[method-assign]


def _stream_no_slices() -> None:
    from subscriber_ext.transport.peers import peer_stream_server

    original = peer_stream_server.PeerStreamServer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["slice_lookup"] = None
        original(self, *args, **kwargs)

    peer_stream_server.PeerStreamServer.__init__ = init  # type: ignore[method-assign]


def _stream_chunk0_gone() -> None:
    from subscriber_ext.transport.peers import peering
    from subscriber_ext.transport.peers.peer_server import GONE

    original = peering.Peering._stream_slice_lookup

    def lookup(self: Any, publisher_id: str, version: int, chunk: int, blocks: Any) -> Any:
        return GONE if chunk == 0 else original(self, publisher_id, version, chunk, blocks)

    peering.Peering._stream_slice_lookup = lookup  # type: ignore[method-assign]


SWALLOWED: list[int] = []  # chunks asked of a stalling member, one entry per request


def _stall_every_request() -> None:
    from subscriber_ext.transport.peers import peer_server
    from weightpub_wire import protocol as wire

    def on_request(self: Any, frames: list[Any], now: float) -> None:
        try:
            SWALLOWED.append(len(wire.decode_as(frames[-1].buffer, wire.FetchRequest).chunks))
        except Exception:
            SWALLOWED.append(0)

    peer_server.PeerServer._on_request = on_request  # type: ignore[method-assign]


def _planned_mismatches(staged: Any, want: dict[str, Any], rank: int) -> list[str]:
    """[] when ``staged`` holds exactly ``want``'s planned bytes (zeros elsewhere)."""
    from tests.transport.test_slice_fetch import assert_planned

    try:
        assert_planned(staged, want, rank)
    except AssertionError as exc:
        return [f"planned bytes: {exc}"]
    return []


def run_peer(args: dict[str, Any]) -> None:
    from subscriber_ext import SyncOptions, WeightSubscriber

    if args.get("corrupt"):
        _corrupt_what_it_serves()
    if args.get("stall"):
        _stall_every_request()
    if args.get("stream_corrupt"):
        _corrupt_what_it_streams(short=args["stream_corrupt"] == "short")
    if args.get("stream_unsliced"):
        _stream_no_slices()
    if args.get("stream_gone"):
        _stream_chunk0_gone()
    staged_q: queue.Queue[Any] = queue.Queue()
    rank = args.get("slice_rank")
    sliced: dict[str, Any] = {}
    if rank is not None:
        from tests.transport.test_slice_fetch import half_plan

        sliced["slice_plan"] = half_plan(rank, args["spec"])
    sub = WeightSubscriber(args["endpoint"], options=SyncOptions(**args.get("options", {})),
                           on_version=staged_q.put, peer_share=True,
                           subscriber_id=args.get("name", f"peer-{os.getpid()}"),
                           **sliced, **args.get("peer", {}))
    _emit(event="ready", pid=os.getpid(), subscriber_id=sub.subscriber_id)
    commands = _commands()
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command is not None:
            if command.get("cmd") == "exit":
                break
            if command.get("cmd") == "status":
                _emit(event="status", id=command.get("id"), status=sub.status(),
                      swallowed=list(SWALLOWED))
        try:
            staged = staged_q.get(timeout=0.05)
        except queue.Empty:
            continue
        want_tensors = det_weights(args["seed"], staged.version, args["spec"])
        if rank is not None:
            mismatches = _planned_mismatches(staged, want_tensors, rank)
        else:
            got = digests(staged.items())
            want = digests(want_tensors.items())
            mismatches = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        _emit(event="staged", version=staged.version, publisher_id=staged.publisher_id,
              mismatches=mismatches, fetch_seconds=staged.fetch_seconds,
              data_path=staged.data_path)
        staged.release()
    sub.close()
    _emit(event="closed")
