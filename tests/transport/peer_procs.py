"""Child side of the peer-sharing tests: one ``peer_share=True`` subscriber process.

Run through ``tests.transport.procs`` (role ``peer``). It reports every staged
version (digests per tensor, checked against ``det_weights``) and answers
``status``. ``corrupt: true`` makes its peer server flip a byte of every chunk it
serves (a peer gone bad: its own staging stays correct, what it sends is not).
``stall: true`` makes it read every request and answer none (a sybil: it says hello,
stays connected and answers ZMTP heartbeats, so nothing but silence gives it away;
a SIGSTOP'd member instead loses its connections to heartbeats within seconds and
leaves the plan at ``member_ttl``); its status then counts the requests it swallowed.
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
        bad[len(bad) // 2] ^= 0xFF
        return bool(original(self, client, ask, peer_server.Served(memoryview(bad), None)))

    peer_server.PeerServer._send_chunk = send_chunk  # type: ignore[method-assign]


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


def run_peer(args: dict[str, Any]) -> None:
    from subscriber_ext import SyncOptions, WeightSubscriber

    if args.get("corrupt"):
        _corrupt_what_it_serves()
    if args.get("stall"):
        _stall_every_request()
    staged_q: queue.Queue[Any] = queue.Queue()
    sub = WeightSubscriber(args["endpoint"], options=SyncOptions(**args.get("options", {})),
                           on_version=staged_q.put, peer_share=True,
                           subscriber_id=args.get("name", f"peer-{os.getpid()}"),
                           **args.get("peer", {}))
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
        got = digests(staged.items())
        want = digests(det_weights(args["seed"], staged.version, args["spec"]).items())
        _emit(event="staged", version=staged.version, publisher_id=staged.publisher_id,
              mismatches=sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k)),
              fetch_seconds=staged.fetch_seconds)
        staged.release()
    sub.close()
    _emit(event="closed")
