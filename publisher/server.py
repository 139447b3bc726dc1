"""The publisher's serving thread: ROUTER requests, PUB manifests and heartbeats.

All ZeroMQ sockets live on this one thread (sockets are not thread-safe);
other threads talk to it through an inproc PULL socket. A request that fails
validation gets an ``error`` reply or is dropped, never an exception that
stops the loop.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from publisher.delta import DeltaPublisher
from publisher.delta_server import DeltaServing
from publisher.store import PublishedVersion, VersionStore
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError
from weightpub_wire.sockets import bind, configure_socket

__all__ = ["ServerOptions", "ServingThread"]

log = logging.getLogger("weightpub.publisher")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    router_bind: str
    pub_bind: str
    heartbeat_interval: float = 1.0
    subscriber_ttl: float = 30.0
    max_subscribers: int = 10_000
    max_request_bytes: int = 16 << 20
    max_chunks_per_request: int = 256
    zero_copy_min_bytes: int = 64 << 10


class ServingThread(threading.Thread):
    """Owns the ROUTER and PUB sockets; announces versions and serves their chunks."""

    def __init__(self, ctx: zmq.Context, store: VersionStore, options: ServerOptions,
                 *, publisher_id: str, started_at: float,
                 configure: list | None = None, deltas: DeltaPublisher | None = None) -> None:
        super().__init__(name="weightpub-server", daemon=True)
        self.ctx = ctx
        self.store = store
        self.options = options
        self.publisher_id = publisher_id
        self.started_at = started_at
        self.command_address = f"inproc://weightpub-cmd-{uuid.uuid4().hex}"
        self.router_endpoint = ""
        self.pub_endpoint = ""
        self._configure = configure or []
        self._reports: dict[str, tuple[wire.Report, float]] = {}
        self._reports_lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._deferred: list[tuple[bytes, int, PublishedVersion, int]] = []
        self.bad_messages = 0
        self.served_bytes = 0  # full chunks; delta chunks: delta_serving.bytes_sent
        self.delta_serving = DeltaServing(  # answers fetches that name a delta base
            deltas, store, publisher_id, max_chunks_per_request=options.max_chunks_per_request,
            zero_copy_min_bytes=options.zero_copy_min_bytes)

    # -- lifecycle -----------------------------------------------------------------------------
    def start_and_wait(self, timeout: float = 10.0) -> None:
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("publisher serving thread did not start")
        if self._error is not None:
            raise self._error

    def send_command(self, *frames: bytes) -> None:
        """Thread-safe: a short-lived PUSH socket per call (commands are rare)."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        try:
            push.connect(self.command_address)
            push.send_multipart(list(frames), flags=0)
        finally:
            push.close()

    def subscriber_reports(self) -> list[tuple[wire.Report, float]]:
        with self._reports_lock:
            return list(self._reports.values())

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            router, pub, commands = self._open_sockets()
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(commands, zmq.POLLIN)
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(pub)
                    next_beat = now + self.options.heartbeat_interval
                timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
                if self._deferred or self.delta_serving.waiting:
                    timeout_ms = min(timeout_ms, 1)  # a copy or an encoding is finishing
                events = dict(poller.poll(timeout_ms))
                if commands in events and not self._on_command(commands, pub):
                    return
                if router in events:
                    self._drain_router(router)
                if self._deferred:
                    self._flush_deferred(router)
                self.delta_serving.flush(router)
        finally:
            for sock in (router, pub, commands):
                sock.close(linger=0)

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        commands = self.ctx.socket(zmq.PULL)
        commands.bind(self.command_address)
        router = self.ctx.socket(zmq.ROUTER)
        pub = self.ctx.socket(zmq.PUB)
        for sock in (router, pub):
            configure_socket(sock, heartbeat_interval=self.options.heartbeat_interval)
            for hook in self._configure:
                hook(sock, server=True)
        router.setsockopt(zmq.SNDHWM, 100_000)
        router.setsockopt(zmq.RCVHWM, 100_000)
        # requests are small; ZeroMQ drops a peer that sends a bigger frame before
        # allocating it, so a hostile client cannot make us buffer gigabytes
        router.setsockopt(zmq.MAXMSGSIZE, self.options.max_request_bytes)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        try:
            self.router_endpoint = bind(router, self.options.router_bind)
            self.pub_endpoint = bind(pub, self.options.pub_bind)
        except BaseException:
            for sock in (router, pub, commands):
                sock.close(linger=0)
            raise
        return router, pub, commands

    def _on_command(self, commands: zmq.Socket, pub: zmq.Socket) -> bool:
        frames = commands.recv_multipart()
        if frames[0] == b"close":
            return False
        if frames[0] == b"announce":
            latest = self.store.latest()
            if latest is not None:
                pub.send(wire.encode(latest.manifest))
                self._heartbeat(pub)
        return True

    def _heartbeat(self, pub: zmq.Socket) -> None:
        latest = self.store.latest()
        beat = wire.Heartbeat(
            publisher_id=self.publisher_id,
            started_at=self.started_at,
            latest_version=0 if latest is None else latest.manifest.version,
            sent_at=time.time(),
            interval=self.options.heartbeat_interval,
        )
        pub.send(wire.encode(beat))
        self.store.recycle()

    def _drain_router(self, router: zmq.Socket) -> None:
        for _ in range(1000):  # bounded so heartbeats are never starved
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.bad_messages += 1
                log.warning("dropped a request of %d frames (expected 2)", len(frames))
                continue
            identity, body = frames[0].bytes, frames[1].buffer
            try:
                request = wire.decode(body, expect=(wire.LatestRequest, wire.FetchRequest,
                                                    wire.StatusRequest, wire.Report))
            except ProtocolError as exc:
                self.bad_messages += 1
                log.warning("dropped a bad request: %s", exc)
                continue
            self._handle(router, identity, request)

    def _handle(self, router: zmq.Socket, identity: bytes, request: wire.Message) -> None:
        if isinstance(request, wire.FetchRequest):
            self._serve_chunks(router, identity, request)
        elif isinstance(request, wire.LatestRequest):
            latest = self.store.latest()
            reply = wire.LatestReply(
                req=request.req, publisher_id=self.publisher_id, started_at=self.started_at,
                pub_endpoint=self.pub_endpoint,
                heartbeat_interval=self.options.heartbeat_interval,
                manifest=None if latest is None else latest.manifest,
            )
            router.send_multipart([identity, wire.encode(reply)])
        elif isinstance(request, wire.StatusRequest):
            router.send_multipart([identity, wire.encode(self._status(request.req))])
        elif isinstance(request, wire.Report):
            now = time.time()
            with self._reports_lock:
                if request.subscriber_id not in self._reports and \
                        len(self._reports) >= self.options.max_subscribers:
                    cutoff = now - self.options.subscriber_ttl
                    self._reports = {k: v for k, v in self._reports.items() if v[1] >= cutoff}
                    if len(self._reports) >= self.options.max_subscribers:
                        self.bad_messages += 1
                        log.warning("dropped a report: %d live subscribers already tracked",
                                    len(self._reports))
                        return
                self._reports[request.subscriber_id] = (request, now)

    def _status(self, req: int) -> wire.StatusReply:
        latest = self.store.latest()
        cutoff = time.time() - self.options.subscriber_ttl
        with self._reports_lock:
            reports = tuple(r for r, seen in self._reports.values() if seen >= cutoff)
        return wire.StatusReply(
            req=req, publisher_id=self.publisher_id, started_at=self.started_at,
            latest_version=0 if latest is None else latest.manifest.version,
            versions=self.store.versions(), subscribers=reports,
            bytes_sent_full=self.served_bytes,
            bytes_sent_delta=self.delta_serving.bytes_sent,
        )

    def _serve_chunks(self, router: zmq.Socket, identity: bytes,
                      request: wire.FetchRequest) -> None:
        if request.base:
            self.delta_serving.serve(router, identity, request)
            return
        version = self.store.get(request.version)
        if version is None or version.failed or request.publisher_id != self.publisher_id:
            error = wire.ErrorReply(req=request.req, code="version_unavailable",
                                    message=f"version {request.version} of publisher "
                                            f"{request.publisher_id} is not held here "
                                            f"(held: {list(self.store.versions())})",
                                    version=request.version)
            router.send_multipart([identity, wire.encode(error)])
            return
        if len(request.chunks) > self.options.max_chunks_per_request or any(
            c >= version.manifest.num_chunks for c in request.chunks
        ):
            error = wire.ErrorReply(req=request.req, code="bad_request",
                                    message="chunk ids out of range or too many in one request",
                                    version=request.version)
            router.send_multipart([identity, wire.encode(error)])
            return
        for chunk in request.chunks:
            if version.chunk_ready(chunk):
                self._send_chunk(router, identity, request.req, version, chunk)
            else:  # announced before its copy ended: send once the bytes are final
                self._deferred.append((identity, request.req, version, chunk))

    def _flush_deferred(self, router: zmq.Socket) -> None:
        waiting = []
        for identity, req, version, chunk in self._deferred:
            if version.failed:
                continue  # the subscriber times out and asks for the latest version
            if version.chunk_ready(chunk):
                self._send_chunk(router, identity, req, version, chunk)
            else:
                waiting.append((identity, req, version, chunk))
        self._deferred = waiting

    def _send_chunk(self, router: zmq.Socket, identity: bytes, req: int,
                    version: PublishedVersion, chunk: int) -> None:
        data = version.chunk_view(chunk)
        self.served_bytes += len(data)
        header = wire.ChunkHeader(req=req, version=version.manifest.version, chunk=chunk,
                                  size=len(data))
        router.send(identity, zmq.SNDMORE)
        router.send(wire.encode(header), zmq.SNDMORE)
        if len(data) >= self.options.zero_copy_min_bytes:
            version.track(router.send(data, copy=False, track=True))
        else:
            router.send(data, copy=True)
