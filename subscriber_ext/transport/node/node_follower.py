"""A node follower: a local rank that uses the owner's subscription instead of its own.

It receives each version the owner staged as an ``Offer`` (the manifest, plus
the buffer's memfd the first time that buffer is used), maps the buffer
read-only once and keeps the mapping for later versions in the same buffer,
and hands its consumer a ``SharedView`` whose ``release`` tells the owner.
Nothing is copied and nothing is fetched. If the owner goes away the follower
keeps what it holds and reconnects when an owner listens again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from subscriber_ext.transport.node.node_channel import (
    Applied,
    Channel,
    Forget,
    Hello,
    Offer,
    Partial,
    Release,
    Status,
    Welcome,
    connect_node,
)
from subscriber_ext.transport.node.shared_segments import map_segment
from subscriber_ext.transport.staging.assembly import SharedView, tensor_views
from subscriber_ext.transport.staging.progress import PartialVersion
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError, WeightPubError

__all__ = ["NodeStagingFollower"]

log = logging.getLogger("weightpub.node")
RECONNECT_S = 0.2


class NodeStagingFollower:
    """A ``VersionSource`` fed by the node owner over ``sock`` (already connected)."""

    def __init__(self, sock: socket.socket, address: bytes, *, rank: int,
                 on_version: Callable[[SharedView], None],
                 on_progress: Callable[[PartialVersion], None] | None = None) -> None:
        self.rank = rank
        self._address = address
        self._on_version = on_version
        self._on_progress = on_progress
        self._partials: dict[int, PartialVersion] = {}  # attempt -> the version arriving
        self._lock = threading.Lock()
        self._channel: Channel | None = None
        self._generation = 0  # one per connection: releases of an old owner go nowhere
        self._segments: dict[int, torch.Tensor] = {}
        self._owner: Welcome | None = None
        self._owner_status: dict[str, Any] = {}
        self._ranks: tuple[int, ...] = ()
        self._applied: tuple[int, str | None] = (0, None)
        self._closed = False
        self._attach(sock)
        self._thread = threading.Thread(target=self._run, name="weightpub-node-follower",
                                        daemon=True)
        self._thread.start()

    # -- VersionSource ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            status = dict(self._owner_status)
            owner = self._owner
            status["node_staging"] = {
                "role": "follower", "rank": self.rank, "pid": os.getpid(),
                "ranks": list(self._ranks),
                "owner_rank": None if owner is None else owner.rank,
                "connected": self._channel is not None,
                "mapped_segments": len(self._segments),
            }
        return status

    def mark_applied(self, version: int, error: str | WeightPubError | None = None) -> None:
        text = None if error is None else str(error)[: wire.MAX_ERROR_CHARS]
        with self._lock:
            self._applied = (version or self._applied[0], text)
            channel = self._channel
        self._send(channel, Applied(version=version, error=text))

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=5)  # it checks ``_closed`` at least every 0.25 s
        with self._lock:
            channel, self._channel = self._channel, None
            self._segments.clear()  # views already handed out keep their mapping
        if channel is not None:
            channel.close()

    # -- connection -------------------------------------------------------------------------
    def _attach(self, sock: socket.socket) -> None:
        channel = Channel(sock)
        channel.send(Hello(rank=self.rank, pid=os.getpid()))
        with self._lock:
            self._channel = channel
            self._generation += 1
            applied = self._applied
        if applied[0]:  # a new owner learns what this rank runs
            self._send(channel, Applied(version=applied[0]))

    def _detach(self, why: str) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
            self._segments.clear()  # segment ids belong to that owner
            self._owner = None
            self._owner_status = {"last_error": f"node staging: owner lost ({why})"}
        if channel is not None:
            channel.close()
            if not self._closed:
                log.warning("node staging: rank %d lost its owner (%s); reconnecting",
                            self.rank, why)

    def _send(self, channel: Channel | None, message: Any) -> None:
        if channel is None:
            return
        try:
            channel.send(message)
        except (OSError, ProtocolError) as exc:
            log.warning("node staging: send to the owner failed: %s", exc)

    def _run(self) -> None:
        while not self._closed:
            channel = self._channel
            if channel is None:
                self._reconnect()
                continue
            try:
                messages = channel.receive(0.25)
            except (OSError, ProtocolError) as exc:
                self._detach(str(exc))
                continue
            if messages is None:
                self._detach("disconnected")
                continue
            for message, fd in messages:
                try:
                    self._handle(message, fd)
                except Exception:  # one bad offer must not stop the follower
                    log.exception("node staging: could not take %s", type(message).__name__)

    def _reconnect(self) -> None:
        time.sleep(RECONNECT_S)
        try:
            sock = connect_node(self._address, timeout=1.0)
            if sock is not None and not self._closed:
                self._attach(sock)
                log.info("node staging: rank %d re-attached", self.rank)
            elif sock is not None:
                sock.close()
        except (OSError, ProtocolError) as exc:
            log.warning("node staging: reconnect failed: %s", exc)

    # -- messages from the owner ------------------------------------------------------------
    def _handle(self, message: Any, fd: int | None) -> None:
        if isinstance(message, Offer):
            self._offer(message, fd)
        elif isinstance(message, Partial):
            self._partial(message, fd)
        elif isinstance(message, Forget):
            with self._lock:
                self._segments.pop(message.segment, None)
        elif isinstance(message, Status):
            with self._lock:
                self._owner_status = dict(message.fields)
                self._ranks = message.ranks
        elif isinstance(message, Welcome):
            with self._lock:
                self._owner = message
            log.info("node staging: rank %d follows rank %d (pid %d)", self.rank, message.rank,
                     message.pid)
        if fd is not None and not isinstance(message, (Offer, Partial)):
            os.close(fd)

    def _map(self, segment: int, segment_bytes: int, fd: int | None) -> torch.Tensor | None:
        if fd is not None:
            try:
                mapped = map_segment(fd, segment_bytes)
            finally:
                os.close(fd)
            with self._lock:
                self._segments[segment] = mapped
        with self._lock:
            return self._segments.get(segment)

    def _partial(self, message: Partial, fd: int | None) -> None:
        """The owner's version still arriving: pass its final prefix on to this rank."""
        if message.manifest is not None:
            mapped = self._map(message.segment, message.segment_bytes, fd)
            if mapped is None:
                raise ProtocolError(f"partial of attempt {message.attempt}: segment "
                                    f"{message.segment} was never sent")
            partial = PartialVersion(message.manifest, mapped, message.attempt)
            with self._lock:
                self._partials[message.attempt] = partial
                while len(self._partials) > 4:  # bounded: the owner cancels or completes
                    self._partials.pop(next(iter(self._partials)))
        else:
            if fd is not None:
                os.close(fd)
            with self._lock:
                found = self._partials.get(message.attempt)
            if found is None:
                return  # an attempt this rank never saw (it attached mid-version)
            partial = found
        partial.mark_ready(message.ready)  # out-of-range indices are ignored
        if message.cancelled:
            partial.cancelled = True
            with self._lock:
                self._partials.pop(message.attempt, None)
        if self._on_progress is not None:
            self._on_progress(partial)

    def _offer(self, offer: Offer, fd: int | None) -> None:
        with self._lock:
            channel, generation = self._channel, self._generation
            self._partials.pop(offer.attempt, None)
        mapped = self._map(offer.segment, offer.segment_bytes, fd)
        release = self._releaser(channel, generation, offer.share)
        if mapped is None:
            release()
            raise ProtocolError(f"offer of version {offer.manifest.version}: segment "
                                f"{offer.segment} was never sent")
        try:
            view = SharedView(offer.manifest, tensor_views(offer.manifest, mapped), release,
                              offer.fetch_seconds, offer.data_path, offer.attempt)
        except ValueError:
            release()
            raise
        try:
            self._on_version(view)
        except BaseException:
            view.release()
            raise

    def _releaser(self, channel: Channel | None, generation: int,
                  share: int) -> Callable[[], None]:
        def release() -> None:
            with self._lock:
                current = self._generation == generation and self._channel is channel
            if current:
                self._send(channel, Release(share=share))
        return release
