"""Child processes of the fault matrix: publishers and relays that die by SIGKILL on cue.

Children are forked from a ``forkserver`` that has already imported torch and
the packages, so starting one costs milliseconds, not an interpreter start.
A ``kill_at`` point makes the child send itself SIGKILL at an exact place in
the real code (a patched function calls ``os.kill(os.getpid(), SIGKILL)``):
a real ``kill -9``, with no chance to clean up, at a deterministic moment.
``clock_offset`` shifts the child's wall clock (``time.time``) only.

Kill points (``kill_at``):

- ``announce``: a version is snapshotted and hashed, killed before its manifest is sent
- ``announce_cmd``: the manifest is in the store, killed before PUB sends it
- ``copy:<f>``: after fraction ``f`` of a version's bytes were copied (manifest may be out);
  in a cut-through relay: written into the downstream version
- ``chunk:<n>``: when about to send chunk frame number ``n`` (counting from the first
  version's); ``chunk_after:<n>``: just after sending it
- ``latest:<n>``: the n-th ``latest`` request of a peer that first spoke after version 2
  was out (a late joiner); ``report:<n>``: the n-th report once version 2 is out;
  ``status:<n>``: the n-th status request
- ``forward``: (relay) an upstream version starts arriving, killed before it is announced
  downstream
- ``stream_chunk:<n>``: (``stream=True``) when about to put stream chunk number ``n``
  (counting from the first version's; a slice's chunk counts too) into a ``sendmsg``
- ``sums:<n>``: (``announce_early=True``) the n-th ``chunk_sums`` request once version 2
  is out; the last sum of the second version's feed is withheld (a hash that has not
  ended), so its sums are still following and the subscriber does ask
- ``submit``: (a ``ShardedPublisher`` rank) its shard of version 2 or later is hashed,
  killed before it is submitted to the coordinator
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from tests.transport.procs import det_weights

__all__ = ["mp_context", "publisher_child", "relay_child", "shard_rank_child"]

_CONTEXT: Any = None


def mp_context() -> Any:
    """The forkserver context (preloads torch and the packages once)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "zmq", "msgspec", "publisher",
                                         "subscriber_ext", "weightpub.relay",
                                         "tests.transport.faults.children"])
    return _CONTEXT


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # never reached


def _install(kill_at: str | None, first_chunk_version: int = 2) -> None:
    """Patch the real code so the process SIGKILLs itself at ``kill_at``."""
    if not kill_at:
        return
    point, _, arg = kill_at.partition(":")
    from publisher import weight_publisher
    from publisher.serving import connection_credit, server
    from publisher.store import snapshot

    if point == "announce":
        original_announce = weight_publisher.WeightPublisher._announce

        def announce(self: Any, number: int, *a: Any, **k: Any) -> None:
            if number >= first_chunk_version:
                _die()
            original_announce(self, number, *a, **k)

        weight_publisher.WeightPublisher._announce = announce  # type: ignore[method-assign]
    elif point == "announce_cmd":
        original_cmd = server.ServingThread._on_command
        seen = {"n": 0}

        def on_command(self: Any, commands: Any, pub: Any) -> bool:
            latest = self.store.latest()
            if latest is not None and latest.manifest.version >= first_chunk_version:
                _die()
            seen["n"] += 1
            return bool(original_cmd(self, commands, pub))

        server.ServingThread._on_command = on_command  # type: ignore[method-assign]
    elif point == "copy":
        fraction = float(arg)
        # both copy paths (in order, largest tensors first) move bytes with copy_bytes
        copying = {"total": 0, "done": 0}
        original_copy = snapshot.copy_bytes

        def copy_bytes(dst: Any, src: Any) -> None:
            copying["done"] += len(dst)
            total = copying["total"]
            if total > 1 << 20 and copying["done"] >= fraction * total:
                _die()
            original_copy(dst, src)

        def counted(copy: Any) -> Any:
            def run(snap: Any, *args: Any, **kwargs: Any) -> None:
                copying.update(total=snap.total_bytes, done=0)
                copy(snap, *args, **kwargs)
            return run

        snapshot.copy_bytes = copy_bytes
        from publisher import version_preparer

        for module in (weight_publisher, version_preparer):  # wherever the copy is called
            for copy in ("copy_into", "copy_in_priority_order"):
                if hasattr(module, copy):
                    setattr(module, copy, counted(getattr(snapshot, copy)))
        assert hasattr(version_preparer, "copy_into"), "the copy moved: patch its caller"
        from publisher.serving import relayed

        original_write = relayed.RelayedVersion.write_chunk

        def write_chunk(self: Any, chunk: int, data: Any) -> None:
            total = self.published.manifest.total_bytes
            if total > 1 << 20 and self.written_bytes + len(data) >= fraction * total:
                _die()
            original_write(self, chunk, data)

        relayed.RelayedVersion.write_chunk = write_chunk  # type: ignore[method-assign]
    elif point in ("chunk", "chunk_after"):
        target = int(arg)
        original_send = connection_credit.PeerTable._send_chunk
        count = {"n": 0}

        def send(self: Any, peer: Any, header: Any, data: Any, *rest: Any) -> bool | None:
            count["n"] += 1  # every chunk reply (one frame) goes through here
            if count["n"] >= target and point == "chunk":
                _die()
            sent: bool | None = original_send(self, peer, header, data, *rest)
            if count["n"] >= target:
                time.sleep(0.05)  # let ZeroMQ's I/O thread write it
                _die()
            return sent

        connection_credit.PeerTable._send_chunk = send  # type: ignore[method-assign]
    elif point == "stream_chunk":
        _install_stream_chunk(int(arg))
    elif point in ("latest", "report", "status", "sums"):
        if point == "sums":
            _withhold_a_sum()
        from weightpub_wire import protocol as wire
        from weightpub_wire.sum_messages import ChunkSums

        kind = {"latest": wire.LatestRequest, "report": wire.Report,
                "status": wire.StatusRequest, "sums": ChunkSums}[point]
        nth = int(arg)
        original_handle = server.ServingThread._handle
        count = {"n": 0}
        early: set[bytes] = set()  # peers seen before v2: not the late joiner

        def handle(self: Any, peers_: Any, peer: Any, request: Any, *a: Any) -> None:
            latest = self.store.latest()
            # latest/report: armed once v2 is out, so v1 always gets through first;
            # latest: only a peer that first spoke after v2 (the late joiner) counts
            armed = point == "status" or (latest is not None and latest.manifest.version >= 2)
            if not armed:
                early.add(peer.identity)
            elif point == "latest" and peer.identity in early:
                armed = False
            if isinstance(request, kind) and armed:
                count["n"] += 1
                if count["n"] >= nth:
                    _die()
            original_handle(self, peers_, peer, request, *a)

        server.ServingThread._handle = handle  # type: ignore[method-assign]
    elif point == "submit":
        from publisher import sharded_publisher

        original_encode = sharded_publisher.encode_submit

        def encode_submit(submit: Any) -> bytes:
            if submit.version >= first_chunk_version:
                _die()
            return original_encode(submit)

        sharded_publisher.encode_submit = encode_submit
    elif point != "forward":
        raise ValueError(f"unknown kill point {kill_at!r}")


def _withhold_a_sum() -> None:
    """The second ``SumFeed`` made (version 2's here) never gets its last chunk's sum."""
    from publisher.store import sum_feed

    original_init, original_put = sum_feed.SumFeed.__init__, sum_feed.SumFeed.put
    made = {"n": 0}

    def init(self: Any, num_chunks: int) -> None:
        made["n"] += 1
        self.withhold = num_chunks - 1 if made["n"] == 2 else -1
        original_init(self, num_chunks)

    def put(self: Any, chunk: int, value: int) -> None:
        if chunk != self.withhold:
            original_put(self, chunk, value)

    sum_feed.SumFeed.__init__ = init  # type: ignore[method-assign]
    sum_feed.SumFeed.put = put  # type: ignore[method-assign]


def _install_stream_chunk(target: int) -> None:
    """Die when the stream port is about to send its ``target``-th chunk: every whole chunk
    and every slice's source chunk is read out of ``chunk_bytes`` before its ``sendmsg``."""
    from publisher.serving import stream_server

    original = stream_server.StreamServer.chunk_bytes
    count = {"n": 0}

    def chunk_bytes(self: Any, version: Any, chunk: int) -> memoryview:
        count["n"] += 1
        if count["n"] >= target:
            _die()
        return original(self, version, chunk)

    stream_server.StreamServer.chunk_bytes = chunk_bytes  # type: ignore[method-assign]


def _shift_clock(offset: float) -> None:
    if offset:
        real = time.time
        time.time = lambda: real() + offset  # this process only


def _exact_rss() -> None:
    """Make glibc return freed big buffers to the OS at once (fixed mmap threshold), so the
    RSS the tests read is what the process still holds, not what the allocator kept."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB


def _publish_on_command(conn: multiprocessing.connection.Connection, seed: int,
                        publish: Callable[..., int], wait: Callable[..., None]) -> None:
    """("publish", version, spec) -> publish ``det_weights``, ``wait`` for it, then
    ("published", version); "exit" (or 10 minutes of silence) ends it."""
    while conn.poll(600):
        command = conn.recv()
        if command[0] == "exit":
            break
        if command[0] == "publish":
            _, version, spec = command
            publish(det_weights(seed, version, spec), version=version)
            wait(version, timeout=60)
            conn.send(("published", version))


def publisher_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """Commands over ``conn``: ("publish", version, spec) -> ("published", version); "exit"."""
    faulthandler.dump_traceback_later(30, exit=True)  # a start that hangs shows where
    _shift_clock(args.get("clock_offset", 0.0))
    if args.get("exact_rss"):
        _exact_rss()
    _install(args.get("kill_at"))
    from publisher import WeightPublisher
    from publisher.serving.connection_credit import PeerLimits
    from publisher.serving.server import ServerLimits

    limits = ServerLimits(peers=PeerLimits(stall_timeout=args.get("stall_timeout", 30.0)))
    pub = WeightPublisher(args["endpoint"], chunk_size=args.get("chunk_size", 128 << 10),
                          heartbeat_interval=args.get("heartbeat_interval", 0.2),
                          keep_versions=args.get("keep_versions", 2), limits=limits,
                          stream=args.get("stream", False),
                          announce_early=args.get("announce_early", False))
    conn.send(("ready", pub.endpoint, pub.publisher_id, pub.started_at, os.getpid()))
    faulthandler.cancel_dump_traceback_later()
    _publish_on_command(conn, args["seed"], pub.publish, pub.wait_announced)
    pub.close()


def shard_rank_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]
                     ) -> None:
    """A rank of a ``ShardedPublisher`` (plain tensors, its own names); rank 0 runs the
    coordinator on ``announce``/``coordinator`` and says the union's publisher id."""
    faulthandler.dump_traceback_later(30, exit=True)
    _install(args.get("kill_at"))
    from publisher.sharded_publisher import ShardedPublisher

    pub = ShardedPublisher(args.get("endpoint", "tcp://127.0.0.1:0"), rank=args["rank"],
                           world_size=args["world_size"], coordinator=args["coordinator"],
                           announce_endpoint=args.get("announce"),
                           chunk_size=args.get("chunk_size", 128 << 10),
                           shard_timeout=args.get("shard_timeout", 2.0),
                           heartbeat_interval=0.2, keep_versions=2,
                           stream=args.get("stream", False))
    union_id = pub.shard.publisher_id if pub.coordinator is None else pub.coordinator.publisher_id
    conn.send(("ready", pub.endpoint, union_id, 0.0, os.getpid()))
    faulthandler.cancel_dump_traceback_later()
    _publish_on_command(conn, args["seed"], pub.publish, pub.wait_submitted)
    pub.close()


def relay_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """A relay (``weightpub.relay.Relay``) between ``upstream`` and ``endpoint``."""
    faulthandler.dump_traceback_later(30, exit=True)
    _install(args.get("kill_at"))
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    if args.get("kill_at") == "forward":
        original = Relay._forward

        def forward(self: Any, manifest: Any) -> None:
            if manifest.version >= 2:
                _die()
            original(self, manifest)

        Relay._forward = forward  # type: ignore[method-assign]
    stream = bool(args.get("stream", False))  # both hops on the stream path
    config = RelayConfig.model_validate({
        "upstream": {"endpoint": args["upstream"], "request_timeout": 1.0, "stream": stream},
        "downstream": {"endpoint": args["endpoint"], "chunk_mib": 1,
                       "heartbeat_interval": 0.2, "stream": stream}})
    relay = Relay(config)
    conn.send(("ready", relay.endpoint, relay.publisher.publisher_id, 0.0, os.getpid()))
    faulthandler.cancel_dump_traceback_later()
    while conn.poll(600):
        if conn.recv()[0] == "exit":
            break
    relay.close()
