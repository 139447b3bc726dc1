"""A published version's buffer goes back to the pool only when nothing reads it.

Three threads meet at a ``PublishedVersion``: the server queues zero-copy sends
and tracks them, the delta encoder and collective rounds pin it, and a
``publish()`` retires evicted versions so the pool can hand their buffers to the
next snapshot. A tracker or pin lost to a race, or a send queued just after the
retirement, would put bytes of a newer version on the wire under an older
version's checksums.
"""

from __future__ import annotations

import threading

import torch
import zmq

from publisher.store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool, byte_view


def version(number: int, pool: BufferPool) -> PublishedVersion:
    buffer = pool.take(1024)
    manifest = wire.Manifest(publisher_id="p" * 32, started_at=1.0, version=number,
                             created_at=1.0, model_id="m", chunk_size=1024, total_bytes=1024,
                             tensors=(), checksums=(0,))
    return PublishedVersion(manifest=manifest, buffer=buffer, view=byte_view(buffer))


class Pending:
    """A ``zmq.MessageTracker`` stand-in whose send has not finished until told."""

    def __init__(self) -> None:
        self.done = False


def test_a_version_is_retired_only_when_no_send_or_reader_is_left() -> None:
    pool = BufferPool(max_buffers=4)
    store = VersionStore(keep=1, pool=pool)
    first = version(1, pool)
    store.add(first)
    send = Pending()
    first.track(send)  # type: ignore[arg-type]
    reader = object()
    assert first.pin(reader)
    store.add(version(2, pool))  # evicts version 1
    store.recycle()
    assert not first.retired  # a send and a reader still use its bytes
    send.done = True
    store.recycle()
    assert not first.retired
    first.unpin(reader)
    store.recycle()
    assert first.retired
    assert not first.pin(object())  # nothing starts reading a retired buffer
    with first.sending() as live:
        assert not live  # ... nor sending it


def test_no_tracker_is_lost_while_another_thread_retires() -> None:
    """The server tracks sends while ``publish()`` prunes finished ones: every unfinished
    tracker must still count afterwards (a pin keeps the version from retiring)."""
    target = version(1, BufferPool(max_buffers=1))
    assert target.pin("reader")
    pending = [Pending() for _ in range(20_000)]
    stop = threading.Event()

    def prune_loop() -> None:
        while not stop.is_set():
            assert not target.retire_if_idle()

    checker = threading.Thread(target=prune_loop)
    checker.start()
    try:
        for p in pending:
            with target.sending() as live:
                assert live
                target.track(p)  # type: ignore[arg-type]
    finally:
        stop.set()
        checker.join()
    assert len([t for t in target.trackers if not t.done]) == len(pending)
    target.unpin("reader")
    assert not target.retire_if_idle()  # the sends are still queued
    for p in pending:
        p.done = True
    assert target.retire_if_idle()


def test_a_real_tracker_counts_until_zeromq_has_sent_the_frame() -> None:
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        target = version(1, BufferPool(max_buffers=1))
        target.buffer.copy_(torch.arange(1024) % 251)
        with target.sending() as live:
            assert live
            target.track(push.send(target.view, copy=False, track=True))
        assert bytes(pull.recv()) == bytes(target.view)
        target.trackers[0].wait(5)
        assert target.retire_if_idle()
    finally:
        ctx.destroy(linger=0)
