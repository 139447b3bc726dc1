"""The publisher's collective data path: form the group, broadcast each version in buckets.

Why a thread of its own: a rendezvous or a broadcast may take seconds (or, with a
dead peer, up to the timeout); ``publish()`` and the ZeroMQ serving thread must
never wait on it. The serving thread only answers polls from the member table
(``collective_members.py``); this thread re-forms the group when members join or
leave (a new epoch each time), and sends every newly announced version as packed
buckets straight out of the version's host buffer (gloo) or through one device
bucket (NCCL), pinned in the store while it goes out.

A round (see ``weightpub_wire.collective_layout``): header, all_gather(ready), the buckets
if anyone is ready, all_gather(verified). Between versions a keepalive header goes
out every ``keepalive`` seconds, so members learn within the timeout that the
publisher is gone. Any failure tears the group down; its members fetch that
version over ZeroMQ frames, and the next epoch is formed with whoever polls
afterwards (a replica that died does not).

Every new epoch starts with a round of the newest version, even one announced
before the epoch formed: a node that asked to join holds that version back for
the group (``collective_member.py``), so it must come. Members that have it say
"not ready" and no bucket moves (the round costs a header and two all_gathers).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from publisher.collective.collective_ipc import IpcExporter
from publisher.collective.collective_members import MemberLimits, MemberTable
from publisher.store.chunk_sizing import LARGEST as LARGEST_CHUNK
from publisher.store.version_store import PublishedVersion
from weightpub_wire import protocol as wire
from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.collective_group import (
    CollectiveGroup,
    GroupError,
    Rendezvous,
    arrived_ranks,
)
from weightpub_wire.collective_layout import (
    KIND_CLOSE,
    KIND_DATA,
    KIND_KEEPALIVE,
    MAX_BUCKET_BYTES,
    CollectiveAnnounce,
    GroupStatus,
    RoundHeader,
    bucket_spans,
    publisher_tag,
)
from weightpub_wire.cuda_ipc import device_uuid
from weightpub_wire.endpoints import WILDCARD_HOSTS
from weightpub_wire.errors import ConfigError

__all__ = ["CollectiveOptions", "CollectivePublisher"]

log = logging.getLogger("weightpub.collective")


@dataclass(frozen=True, slots=True)
class CollectiveOptions:
    backend: str
    host: str | None = None  # where the rendezvous binds, members reach us (None: endpoint's)
    port: int = 0
    bucket_bytes: int = 64 << 20
    timeout: float = 30.0
    keepalive: float = 1.0
    device: str | None = None  # nccl / cuda_ipc: the publisher's GPU (default: current)
    members: MemberLimits = MemberLimits()


def check_options(options: CollectiveOptions, chunk_size: int | None) -> None:
    """``ConfigError`` naming what does not fit, before anything starts.

    ``chunk_size`` None: chosen per version (``publisher.store.chunk_sizing``), a power of
    two up to ``LARGEST_CHUNK``, so a bucket must be a multiple of that.
    """
    try:
        backend = collective_backend(options.backend)
    except ConfigError as exc:
        raise ConfigError(f"collective: {exc}; None: no collective path") from None
    chunk = LARGEST_CHUNK if chunk_size is None else chunk_size
    if not chunk <= options.bucket_bytes <= MAX_BUCKET_BYTES or options.bucket_bytes % chunk:
        what = f"chunk_size {chunk_size}" if chunk_size is not None else \
            f"{chunk}, the largest chunk chosen per version (chunk_size None)"
        raise ConfigError(f"collective_bucket_bytes: {options.bucket_bytes} must be a multiple "
                          f"of {what} and at most {MAX_BUCKET_BYTES}")
    if not 0 < options.keepalive < options.timeout <= 3600:
        raise ConfigError(f"collective_timeout: {options.timeout}s must be in (keepalive "
                          f"{options.keepalive}s, 3600]")
    if backend.needs_cuda and not torch.cuda.is_available():
        raise ConfigError(f"collective: {options.backend!r} needs a CUDA device in the "
                          "trainer process (use 'gloo' on CPUs)")


class CollectivePublisher:
    """The collective path of one ``WeightPublisher`` instance."""

    def __init__(self, options: CollectiveOptions, *, publisher_id: str, started_at: float,
                 chunk_size: int | None) -> None:
        check_options(options, chunk_size)
        self.options = options
        self.backend = options.backend
        self.spec = spec = collective_backend(options.backend)
        self.publisher_id = publisher_id
        self.started_at = started_at
        self._tag = publisher_tag(publisher_id)
        self._device = spec.device(options.device)
        self.table = MemberTable(self.backend, options.members,
                                 device_uuid=device_uuid(self._device) if spec.same_gpu else "")
        self._cond = threading.Condition()
        self._newest: PublishedVersion | None = None
        self._closed = False
        self._group: CollectiveGroup | None = None
        self._last_round = 0
        self._epoch_round = 0  # the newest version sent to this epoch (0: none yet)
        self._last_op = 0.0
        self._bounce: torch.Tensor | None = None  # nccl: one device bucket
        self.rounds = 0
        self.bytes_sent = 0
        self.last_error: str | None = None
        self._rendezvous: Rendezvous | None = None
        self._ipc: IpcExporter | None = None
        if not spec.has_group:  # no group: the version is shared by IPC handle (same GPU)
            self._ipc = IpcExporter(self.table, self._device, options.timeout)
        else:
            self._rendezvous = Rendezvous(options.host or "127.0.0.1", options.port,
                                          timeout=options.timeout)
        self._thread = threading.Thread(target=self._run, name="weightpub-collective-send",
                                        daemon=True)
        self._thread.start()
        log.info("collective path %s on %s:%s (buckets of %d KiB)", self.backend, options.host,
                 self.port, options.bucket_bytes >> 10)

    @property
    def port(self) -> int:
        return 0 if self._rendezvous is None else self._rendezvous.port

    # -- called from other threads ---------------------------------------------------------
    def announce(self) -> CollectiveAnnounce:
        """What manifests and ``latest`` replies say about this path."""
        return CollectiveAnnounce(backend=self.backend, store_port=self.port,
                                  epoch=self.table.epoch, bucket_bytes=self.options.bucket_bytes,
                                  timeout=self.options.timeout, keepalive=self.options.keepalive,
                                  device_uuid=self.table.device_uuid)

    def on_poll(self, client: str, poll: wire.CollectivePoll) -> wire.CollectiveReply:
        """The serving thread: a subscriber's poll (never blocks on the group)."""
        return self.table.poll(client, poll, time.monotonic(), publisher_id=self.publisher_id,
                               started_at=self.started_at)

    def announced(self, version: PublishedVersion) -> None:
        """The preparing thread: ``version`` was announced; send it when the group is free."""
        with self._cond:
            self._newest = version
            self._cond.notify_all()
        if self._ipc is not None:
            self._ipc.offer(version)

    def status(self) -> GroupStatus:
        return self.table.status(time.monotonic(), rounds=self.rounds,
                                 last_version=self._last_round, bytes_sent=self.bytes_sent,
                                 last_error=None if self.last_error is None
                                 else self.last_error[:1024])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self.options.timeout + 5)
        if self._ipc is not None:
            self._ipc.close()
        if self._rendezvous is not None:
            self._rendezvous.close()

    # -- the collective thread -------------------------------------------------------------
    def _run(self) -> None:
        if self._ipc is not None:
            self._ipc.run(lambda: self._closed)
            return
        while not self._closed:
            try:
                self._step()
            except GroupError as exc:
                self._fail(str(exc))
            except Exception as exc:  # never let the path take the publisher down
                log.exception("collective path error")
                self._fail(f"{type(exc).__name__}: {exc}")
        if self._group is not None:
            self._leave("publisher closing")

    def _step(self) -> None:
        due = self.table.reform_due(time.monotonic())
        if self._group is not None and due:
            self._leave("members changed")  # the next epoch waits for them to report back
            return
        if self._group is None:
            if due:
                self._form()
            else:
                self._sleep(0.05)
            return
        version = self._due_version()
        if version is not None:
            self._round(version)
        elif time.monotonic() - self._last_op >= self.options.keepalive:
            # the version of this epoch's last round: members stop holding back older ones
            self._header(RoundHeader(kind=KIND_KEEPALIVE, epoch=self._epoch(),
                                     version=self._epoch_round, publisher=self._tag))
        else:
            self._sleep(min(0.05, self.options.keepalive))

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)

    def _epoch(self) -> int:
        assert self._group is not None
        return self._group.epoch

    def _due_version(self) -> PublishedVersion | None:
        """The newest announced version, if not sent to this epoch yet (its copy may still be
        running: each bucket goes out once its bytes are final, as ZeroMQ chunks do)."""
        with self._cond:
            newest = self._newest
        if newest is None or newest.failed or newest.manifest.version <= self._epoch_round:
            return None
        return newest

    def _form(self) -> None:
        now = time.monotonic()
        plan = self.table.new_plan(now)
        if plan is None:
            return
        assert self._rendezvous is not None
        prefix = f"weightpub/{self.publisher_id}/{plan.epoch}"
        world = len(plan.members) + 1
        members = ", ".join(self.table.subscriber_ids(plan.members))
        log.info("collective: forming epoch %d with %s", plan.epoch, members)
        started = time.monotonic()
        try:
            group = CollectiveGroup(self.backend, self._rendezvous.store, prefix, 0, world,
                                    timeout=self.options.timeout, epoch=plan.epoch,
                                    local_host=self._local_host(), device=self._device)
        except GroupError as exc:
            arrived = arrived_ranks(self._rendezvous.store, prefix, world)
            self.table.end_plan(time.monotonic(), arrived=arrived)
            self.last_error = f"epoch {plan.epoch}: {exc}"
            log.warning("collective: epoch %d not formed (ranks arrived: %s): %s", plan.epoch,
                        arrived, exc)
            return
        self._group = group
        self.table.activate()
        self._epoch_round = 0  # the newest version goes to this epoch too (module docstring)
        self._last_op = time.monotonic()
        log.info("collective: epoch %d formed with %d member(s) in %.2fs", plan.epoch,
                 world - 1, time.monotonic() - started)

    def _local_host(self) -> str | None:
        host = self.options.host
        return None if host in WILDCARD_HOSTS else host

    def _header(self, header: RoundHeader) -> None:
        assert self._group is not None
        self._group.broadcast(header.to_tensor())  # host memory: the control group
        self._last_op = time.monotonic()

    def _round(self, version: PublishedVersion) -> None:
        group = self._group
        assert group is not None
        manifest = version.manifest
        spans = bucket_spans(manifest.total_bytes, self.options.bucket_bytes)
        if not version.pin(self):  # the store keeps the bytes until the round ends
            self._epoch_round = manifest.version  # retired meanwhile: a newer one follows
            return
        started = time.monotonic()
        try:
            self._header(RoundHeader(kind=KIND_DATA, epoch=self._epoch(),
                                     version=manifest.version, total_bytes=manifest.total_bytes,
                                     bucket_bytes=self.options.bucket_bytes, buckets=len(spans),
                                     publisher=self._tag))
            ready = group.all_gather_flags(1)[1:]
            if any(ready):
                for start, size in spans:
                    self._copied(version, start + size)
                    self._bucket(group, version.buffer[start: start + size])
                    self.bytes_sent += size
            verified = group.all_gather_flags(1)[1:]
        finally:
            version.unpin(self)
        self._last_round = self._epoch_round = manifest.version
        self._last_op = time.monotonic()
        self.rounds += 1
        log.info("collective: version %d to %d/%d ready member(s) in %.3fs (%d verified)",
                 manifest.version, sum(ready), len(ready), time.monotonic() - started,
                 sum(verified))

    def _copied(self, version: PublishedVersion, end: int) -> None:
        """Wait (bounded) until ``publish()``'s copy has reached byte ``end``."""
        manifest = version.manifest
        last = (end - 1) // manifest.chunk_size
        deadline = time.monotonic() + self.options.timeout
        while not version.chunk_ready(last):
            if version.failed or time.monotonic() > deadline:
                raise GroupError(f"version {manifest.version}: its snapshot failed or its copy "
                                 f"did not reach byte {end} within {self.options.timeout}s")
            time.sleep(0.0005)

    def _bucket(self, group: CollectiveGroup, source: torch.Tensor) -> None:
        if group.device.type == "cpu":
            group.broadcast(source)  # zero-copy: straight out of the version's buffer
            return
        with group.on_stream():  # not the trainer's stream: never queued behind its step
            if self._bounce is None:
                self._bounce = torch.empty(self.options.bucket_bytes, dtype=torch.uint8,
                                           device=group.device)
            target = self._bounce[: source.numel()]
            target.copy_(source, non_blocking=True)  # NCCL's stream waits for this stream
        group.broadcast(target)  # returns once done: the bounce is free for the next bucket

    def _leave(self, why: str) -> None:
        """Tell the members (CLOSE, bounded) and tear the group down."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            group.broadcast(RoundHeader(kind=KIND_CLOSE, epoch=group.epoch,
                                        publisher=self._tag).to_tensor())
        except GroupError:
            pass  # a member already gone: they all notice within the timeout
        group.close()
        self.table.end_plan(time.monotonic())
        log.info("collective: left epoch %d (%s)", group.epoch, why)

    def _fail(self, why: str) -> None:
        self.last_error = why
        log.warning("collective path failed (members fetch over ZeroMQ): %s", why)
        group, self._group = self._group, None
        if group is not None:
            group.close()
        self.table.end_plan(time.monotonic())
        self._sleep(0.05)
