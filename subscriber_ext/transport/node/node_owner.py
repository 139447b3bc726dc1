"""The node owner: the one local rank whose ``WeightSubscriber`` stages for the whole node.

Why: a TP=N replica used to subscribe N times (N copies pulled, N copies staged
per node). The owner subscribes once, into shared memory (``shared_segments``),
and offers each complete, verified version to its own consumer and to every
attached local rank (``node_channel``). A version's buffer goes back to the
pool only after every holder released it; a rank whose connection drops
(``kill -9`` included) releases all it held, so nothing stays pinned.

The owner reports to the publisher for all its ranks: ``Report.ranks`` lists
them and ``applied_version`` is the version every one of them runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from subscriber_ext.transport.node.node_channel import (
    Applied,
    Channel,
    Forget,
    Hello,
    Release,
    Status,
    Welcome,
)
from subscriber_ext.transport.node.node_offers import Follower, Share, offer_for, partial_for
from subscriber_ext.transport.node.shared_segments import Segment, SharedSegments
from subscriber_ext.transport.staging.assembly import SharedView, StagedVersion, tensor_views
from subscriber_ext.transport.staging.progress import PartialVersion
from subscriber_ext.transport.subscriber import WeightSubscriber
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, WeightPubError

__all__ = ["NodeStagingOwner", "Subscribe"]

log = logging.getLogger("weightpub.node")

#: ``subscribe(on_version, allocator[, on_progress=])``: the owner's ``WeightSubscriber``
Subscribe = Callable[..., WeightSubscriber]
OWN = -1  # holder id of the owner's own consumer
STATUS_EVERY_S = 0.25


class NodeStagingOwner:
    """Owns the node's subscription; a ``VersionSource`` for its own rank."""

    def __init__(self, listener: socket.socket, *, rank: int,
                 on_version: Callable[[SharedView], None], subscribe: Subscribe,
                 label: str,
                 on_progress: Callable[[PartialVersion], None] | None = None) -> None:
        self.rank = rank
        self._on_version = on_version
        self._on_progress = on_progress
        self._listener = listener
        self._lock = threading.RLock()
        self._shares: dict[int, Share] = {}
        self._followers: dict[int, Follower] = {}
        self._applied: dict[int, int] = {}
        self._reported_applied = 0
        self._outbox: deque[tuple[int, Any, int | None]] = deque()
        self._ids = itertools.count(1)
        self._closed = False
        self._last_status: tuple[dict[str, Any], tuple[int, ...]] | None = None
        self._status_sent_at = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._segments = SharedSegments(label, on_free=self._segment_freed)
        try:
            if on_progress is None:
                self._subscriber = subscribe(self._on_staged, self._segments)
            else:  # every rank of the node sees each version grow (``transport/progress``)
                self._subscriber = subscribe(self._on_staged, self._segments,
                                             on_progress=self._on_partial)
        except BaseException:
            self._close_sockets()
            raise
        self._subscriber.set_ranks((rank,))
        self._thread = threading.Thread(target=self._run, name="weightpub-node-owner",
                                        daemon=True)
        self._thread.start()

    # -- VersionSource ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        status = self._subscriber.status()
        with self._lock:
            status["node_staging"] = {
                "role": "owner", "rank": self.rank, "pid": os.getpid(),
                "ranks": list(self._ranks_locked()),
                "shared_versions": sorted(s.staged.version for s in self._shares.values()),
                "shared_bytes": self._segments.total_bytes,
                "memfd": self._segments.name,
            }
        return status

    def mark_applied(self, version: int, error: str | WeightPubError | None = None) -> None:
        self._record_applied(OWN, self.rank, version, error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._subscriber.close()
        self._wake()
        self._thread.join(timeout=10)
        self._segments.close()

    # -- the subscriber thread hands over a verified version --------------------------------
    def _on_staged(self, staged: StagedVersion) -> None:
        segment = self._segments.segment_of(staged.buffer)
        if segment is None:  # not in shared memory (never expected): this rank alone uses it
            log.error("version %d is not in a shared segment; not offered to other ranks",
                      staged.version)
            self._on_version(SharedView(staged.manifest, staged.tensors, staged.release,
                                        staged.fetch_seconds, staged.data_path,
                                        staged.attempt))
            return
        with self._lock:
            share = Share(next(self._ids), staged, segment, {OWN})
            self._shares[share.share_id] = share
            for follower in self._followers.values():
                if follower.rank is not None:
                    self._offer_locked(follower, share)
            self._last_status = None  # followers see the new staged version at once
        self._wake()
        view = SharedView(staged.manifest, tensor_views(staged.manifest, staged.buffer),
                          lambda: self._release(share.share_id, OWN), staged.fetch_seconds,
                          staged.data_path, staged.attempt)
        try:
            self._on_version(view)
        except BaseException:
            view.release()
            raise

    def _offer_locked(self, follower: Follower, share: Share) -> None:
        message, fd = offer_for(follower, share)
        self._outbox.append((follower.conn_id, message, fd))

    # -- the subscriber thread: a version still arriving ------------------------------------
    def _on_partial(self, partial: PartialVersion) -> None:
        """Tell every rank how much of the arriving version is final (its own rank first)."""
        segment = self._segments.segment_of(partial.buffer)
        if segment is not None:
            with self._lock:
                for follower in self._followers.values():
                    if follower.rank is not None:
                        self._partial_locked(follower, partial, segment)
            self._wake()
        if self._on_progress is not None:
            self._on_progress(partial)

    def _partial_locked(self, follower: Follower, partial: PartialVersion,
                        segment: Segment) -> None:
        told = partial_for(follower, partial, segment)
        if told is not None:
            self._outbox.append((follower.conn_id, *told))

    def _release(self, share_id: int, holder: int) -> None:
        with self._lock:
            share = self._shares.get(share_id)
            if share is None or holder not in share.holders:
                return
            share.holders.discard(holder)
            if share.holders:
                return
            del self._shares[share_id]
        share.staged.release()  # back to the pool: reused, or dropped (``_segment_freed``)

    def _segment_freed(self, segment_id: int) -> None:
        with self._lock:
            for follower in self._followers.values():
                if segment_id in follower.known_segments:
                    follower.known_segments.discard(segment_id)
                    self._outbox.append((follower.conn_id, Forget(segment=segment_id), None))
        self._wake()

    # -- applied versions, for the report ---------------------------------------------------
    def _ranks_locked(self) -> tuple[int, ...]:
        ranks = {self.rank} | {f.rank for f in self._followers.values() if f.rank is not None}
        return tuple(sorted(ranks))

    def _record_applied(self, holder: int, rank: int, version: int,
                        error: str | WeightPubError | None) -> None:
        if error is not None:
            problem = error if isinstance(error, WeightPubError) else f"rank {rank}: {error}"
            self._subscriber.mark_applied(0, problem)
        with self._lock:
            if version:
                self._applied[holder] = version
            served = [OWN, *(f.conn_id for f in self._followers.values() if f.rank is not None)]
            common = min(self._applied.get(h, 0) for h in served)
            if not common or common == self._reported_applied:
                return
            self._reported_applied = common
        self._subscriber.mark_applied(common)

    # -- the owner thread: connections, follower messages, outgoing frames ------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already pending (buffer full) or closed: the loop wakes anyway

    def _run(self) -> None:
        try:
            while not self._closed:
                self._step()
        except Exception:
            log.exception("node owner loop failed; local ranks lose their shared staging")
        finally:
            with self._lock:
                followers = list(self._followers.values())
            for follower in followers:
                self._drop(follower, "owner closing")
            self._close_sockets()

    def _step(self) -> None:
        with self._lock:
            channels = {f.channel.fileno(): f for f in self._followers.values()}
        listener, wake = self._listener.fileno(), self._wake_r.fileno()
        readable, _, _ = select.select([listener, wake, *channels], [], [], STATUS_EVERY_S)
        if wake in readable:
            self._wake_r.recv(4096)
        if listener in readable:
            self._accept()
        for fileno in readable:
            follower = channels.get(fileno)
            if follower is not None:
                self._read(follower)
        self._push_status()
        self._flush()

    def _accept(self) -> None:
        sock, _ = self._listener.accept()
        if len(self._followers) >= wire.MAX_REPORTED_RANKS:
            log.warning("node channel: %d ranks attached already; refused one more",
                        len(self._followers))
            sock.close()
            return
        try:
            channel = Channel(sock)
        except (OSError, ProtocolError) as exc:
            log.warning("node channel: refused a connection: %s", exc)
            sock.close()
            return
        follower = Follower(next(self._ids), channel)
        with self._lock:
            self._followers[follower.conn_id] = follower

    def _read(self, follower: Follower) -> None:
        try:
            messages = follower.channel.receive(0)
        except (OSError, ProtocolError) as exc:
            self._drop(follower, str(exc))
            return
        if messages is None:
            self._drop(follower, "disconnected")
            return
        for message, fd in messages:
            if fd is not None:
                os.close(fd)  # followers never send descriptors
            if isinstance(message, Hello):
                self._hello(follower, message)
            elif follower.rank is None:
                self._drop(follower, "spoke before hello")
                return
            elif isinstance(message, Release):
                self._release(message.share, follower.conn_id)
            elif isinstance(message, Applied):
                self._record_applied(follower.conn_id, follower.rank, message.version,
                                     message.error)

    def _hello(self, follower: Follower, hello: Hello) -> None:
        with self._lock:
            follower.rank = hello.rank
            self._outbox.append((follower.conn_id, Welcome(
                rank=self.rank, pid=os.getpid(),
                subscriber_id=self._subscriber.subscriber_id), None))
            for share in sorted(self._shares.values(), key=lambda s: s.staged.version):
                self._offer_locked(follower, share)
            ranks = self._ranks_locked()
        self._last_status = None  # the newcomer gets the status at once
        self._subscriber.set_ranks(ranks)
        log.info("node staging: rank %d attached (pid %d); serving ranks %s", hello.rank,
                 hello.pid, list(ranks))

    def _drop(self, follower: Follower, why: str) -> None:
        with self._lock:
            if self._followers.pop(follower.conn_id, None) is None:
                return
            held = [s.share_id for s in self._shares.values() if follower.conn_id in s.holders]
            self._applied.pop(follower.conn_id, None)
            unsent = [m for m in self._outbox if m[0] == follower.conn_id]
            self._outbox = deque(m for m in self._outbox if m[0] != follower.conn_id)
            ranks = self._ranks_locked()
        for _, _, fd in unsent:
            if fd is not None:
                os.close(fd)
        follower.channel.close()
        for share_id in held:  # a crashed rank must not pin a buffer
            self._release(share_id, follower.conn_id)
        if follower.rank is not None:  # a stopping rank and a killed one look alike here
            log.info("node staging: rank %d detached (%s); serving ranks %s", follower.rank,
                     why, list(ranks))
            if not self._closed:
                self._subscriber.set_ranks(ranks)
                self._record_applied(OWN, self.rank, 0, None)  # the common version may move

    def _push_status(self) -> None:
        now = time.monotonic()
        if self._last_status is not None and now - self._status_sent_at < STATUS_EVERY_S:
            return
        status = {k: v for k, v in self._subscriber.status().items()
                  if v is None or isinstance(v, (str, int, float, bool))}  # what Status carries
        with self._lock:
            ranks = self._ranks_locked()
            if (status, ranks) == self._last_status:
                return
            self._last_status = (status, ranks)
            self._status_sent_at = now
            message = Status(fields=status, ranks=ranks)
            for follower in self._followers.values():
                if follower.rank is not None:
                    self._outbox.append((follower.conn_id, message, None))

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                conn_id, message, fd = self._outbox.popleft()
                follower = self._followers.get(conn_id)
            try:
                if follower is not None:
                    follower.channel.send(message, fd)
            except (OSError, ProtocolError) as exc:
                if follower is not None:
                    self._drop(follower, f"send failed: {exc}")
            finally:
                if fd is not None:
                    os.close(fd)

    def _close_sockets(self) -> None:
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
