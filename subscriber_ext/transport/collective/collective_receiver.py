"""The receiving thread of the collective path: join a group epoch, take its rounds.

Why a thread of its own: a rendezvous and every broadcast block (bounded by the
announced timeout); the subscriber thread must keep serving ZeroMQ meanwhile,
since that is where any failed round is fetched again.

A group member loops on round headers (``weightpub_wire.collective_layout``): keepalive,
data, or close. For a data round it asks the subscriber thread for a staging
buffer, says in the ready all_gather whether it has one, receives every bucket
(into the buffer, or into a scratch bucket it throws away when it is not ready:
the group needs every member in every broadcast), verifies the chunks of each
bucket on a helper thread while the next one arrives, reports in the verified
all_gather, and hands the buffer back: staged when every chunk matched, else
abandoned and the version fetched over ZeroMQ.

Where the bytes land: gloo receives straight into the host staging buffer (the
node's memfd, or private memory). NCCL needs device memory: each bucket arrives
in one device bucket of this node's GPU and is copied to the host staging buffer,
where the same xxh3-64 chunk checksums are checked (one D2H copy per bucket; the
checksums of bucket i run while bucket i + 1 arrives). ``cuda_ipc`` copies from
the publisher's device buffer the same way.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from subscriber_ext.transport.staging.assembly import Assembly
from weightpub_wire import protocol as wire
from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.collective_group import (
    CollectiveGroup,
    GroupError,
    connect_store,
    local_address_towards,
)
from weightpub_wire.collective_layout import (
    KIND_CLOSE,
    KIND_KEEPALIVE,
    CollectiveAnnounce,
    IpcHandle,
    RoundHeader,
    bucket_spans,
    publisher_tag,
)
from weightpub_wire.cuda_ipc import open_buffer, side_stream
from weightpub_wire.errors import TransportError

__all__ = ["LATER", "CollectiveReceiver", "GroupJob", "IpcJob", "Member"]

log = logging.getLogger("weightpub.collective")
MANIFEST_WAIT_S = 1.0  # a round may name a version whose manifest is still on its way
LATER = "later"  # ``Member.begin``: the manifest of that version has not arrived yet


class Member(Protocol):
    """What the receiver needs of its ``CollectiveMember`` (``collective.py``)."""

    announced: CollectiveAnnounce | None
    limits: wire.Limits
    ipc_done: int

    def call(self, function: Callable[[Any], Any], timeout: float = 5.0) -> Any: ...
    def begin(self, client: Any, version: int, total_bytes: int | None,
              backend: str) -> Assembly | str | None: ...
    def finish(self, client: Any, assembly: Assembly, nbytes: int) -> None: ...
    def failed(self, client: Any, version: int, assembly: Assembly | None,
               why: str, cause: str = ...) -> None: ...
    def left(self, client: Any, why: str, cause: str = ...) -> None: ...
    def verified(self, client: Any, assembly: Assembly, chunks: range) -> None: ...


@dataclass(frozen=True, slots=True)
class GroupJob:
    """Join ``epoch`` as ``rank`` of ``world_size`` and take its rounds until it ends."""

    epoch: int
    rank: int
    world_size: int
    announce: CollectiveAnnounce
    host: str
    publisher_id: str
    device: torch.device


@dataclass(frozen=True, slots=True)
class IpcJob:
    """Copy one version out of the publisher's device buffer (``cuda_ipc``)."""

    handle: IpcHandle
    announce: CollectiveAnnounce
    device: torch.device


class _Verifier:
    """Checks each received bucket's chunks on a helper thread (xxh3 releases the GIL);
    ``on_verified`` hears each bucket that matched (its tensors may be prepared early)."""

    def __init__(self, assembly: Assembly,
                 on_verified: Callable[[range], None] | None = None) -> None:
        self.assembly = assembly
        self.on_verified = on_verified
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightpub-collective-verify")
        self._results: list[Future[bool]] = []

    def submit(self, start: int, size: int) -> None:
        chunk_size = self.assembly.manifest.chunk_size
        chunks = range(start // chunk_size, (start + size - 1) // chunk_size + 1)
        self._results.append(self._pool.submit(self._check, chunks))

    def _check(self, chunks: range) -> bool:
        ok = all([self.assembly.verify(c) for c in chunks])
        if ok and self.on_verified is not None:
            self.on_verified(chunks)
        return ok

    def ok(self) -> bool:
        try:
            return all(f.result() for f in self._results) and not self.assembly.missing
        finally:
            self._pool.shutdown(wait=True)


class CollectiveReceiver(threading.Thread):
    """One per subscriber; does one job at a time (a group epoch, or one IPC copy)."""

    def __init__(self, member: Member) -> None:
        super().__init__(name="weightpub-collective-rx", daemon=True)
        self.member = member
        self.state = "free"
        self.epoch = 0  # the newest epoch joined or being joined
        self.publisher_id = ""  # whose epoch (a restarted publisher counts from 1 again)
        self.receiving = 0  # the version of the round under way
        self.passed = 0  # rounds up to this version are over (the root's keepalive says)
        self._jobs: queue.Queue[GroupJob | IpcJob] = queue.Queue(maxsize=1)
        self._stopping = threading.Event()
        self._scratch: torch.Tensor | None = None
        self._bounce: torch.Tensor | None = None
        self._stopped_at = 0.0

    def poll_state(self, publisher_id: str | None) -> tuple[str, int]:
        """(state, epoch) as ``publisher_id`` should see them (another instance's epoch: 0)."""
        epoch = self.epoch if publisher_id == self.publisher_id else 0
        state = "leaving" if self._stopping.is_set() else self.state
        if epoch == 0 and state != "leaving":
            state = "free" if state == "free" else "joining"  # busy with an old instance
        return state, epoch

    def ready_for_rounds(self) -> bool:
        """Whether versions should wait for this path (a group member, or cuda_ipc)."""
        info = self.member.announced
        if info is not None and not collective_backend(info.backend).has_group:
            return not self._stopping.is_set()
        return self.state == "member"

    def submit(self, job: GroupJob | IpcJob) -> None:
        """From the subscriber thread: ignored unless idle (and a new epoch)."""
        if self.state != "free":
            return
        if isinstance(job, GroupJob):
            if job.publisher_id == self.publisher_id and job.epoch <= self.epoch:
                return  # an epoch this receiver already joined (or failed to)
            self.epoch, self.publisher_id = job.epoch, job.publisher_id
            self.passed = 0
            self.state = "joining"
        else:
            self.state = "copying"
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.state = "free"

    def stop(self) -> None:
        self._stopping.set()
        self._stopped_at = time.monotonic()
        info = self.member.announced
        self.join(timeout=2 * (info.keepalive if info is not None else 1.0) + 1.0)

    def _linger(self, info: CollectiveAnnounce) -> bool:
        """After ``stop``: stay in the group (up to two keepalives) until the publisher,
        told that this node leaves, closes the epoch, so its next broadcast does not fail."""
        return time.monotonic() - self._stopped_at < 2 * info.keepalive

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if isinstance(job, GroupJob):
                    self._serve(job)
                else:
                    self._copy(job)
            except Exception as exc:  # never let the thread die: zmq stays the fallback
                log.exception("collective receiver error")
                failure = f"{type(exc).__name__}: {exc}"
                self.member.call(functools.partial(self.member.left, why=failure,
                                                   cause="receiver_error"))
            finally:
                self.state = "free"
                self.receiving = 0
                self._scratch = None

    # -- a group epoch ---------------------------------------------------------------------
    def _serve(self, job: GroupJob) -> None:
        info = job.announce
        why = ""
        try:
            store = connect_store(job.host, info.store_port, info.timeout)
            group = CollectiveGroup(
                info.backend, store, f"weightpub/{job.publisher_id}/{job.epoch}", job.rank,
                job.world_size, timeout=info.timeout, epoch=job.epoch,
                local_host=local_address_towards(job.host, info.store_port),
                device=job.device)
        except (GroupError, OSError) as exc:
            log.warning("collective: could not join epoch %d: %s", job.epoch, exc)
            failure = f"join failed: {exc}"
            self.member.call(lambda client: self.member.left(client, failure, "join_failed"))
            return
        self.state = "member"
        log.info("collective: joined epoch %d as rank %d of %d (%s)", job.epoch, job.rank,
                 job.world_size, info.backend)
        tag = publisher_tag(job.publisher_id)
        cause = "closing"  # "" below: the publisher closed the epoch (a re-form, not a failure)
        try:
            while not self._stopping.is_set() or self._linger(info):
                words = RoundHeader.empty()  # host memory: the control group, no GPU spin
                group.broadcast(words)
                header = RoundHeader.from_tensor(
                    words, epoch=job.epoch, publisher=tag, bucket_bytes=info.bucket_bytes,
                    max_total_bytes=self.member.limits.max_total_bytes)
                if header.kind == KIND_CLOSE:
                    why, cause = "the publisher closed the epoch", ""
                    break
                if header.kind == KIND_KEEPALIVE:
                    self.passed = max(self.passed, header.version)
                else:
                    self._round(group, header, info.backend)
                    self.passed = max(self.passed, header.version)
        except (GroupError, ValueError, TransportError) as exc:
            why, cause = str(exc), "group_lost"
            log.warning("collective: epoch %d lost: %s", job.epoch, exc)
        finally:
            group.close()
            self._bounce = None
            self.state = "free"
        self.member.call(lambda client: self.member.left(client, why, cause))

    def _begin(self, version: int, total_bytes: int | None, backend: str) -> Assembly | None:
        deadline = time.monotonic() + MANIFEST_WAIT_S
        while True:
            got = self.member.call(
                lambda client: self.member.begin(client, version, total_bytes, backend))
            if got != LATER or time.monotonic() >= deadline:
                return got if isinstance(got, Assembly) else None
            time.sleep(0.02)

    def _round(self, group: CollectiveGroup, header: RoundHeader, backend: str) -> None:
        self.receiving = header.version
        assembly = self._begin(header.version, header.total_bytes, backend)
        verifier = None if assembly is None else self._verifier(assembly)
        ok = False
        try:
            ready = group.all_gather_flags(1 if assembly is not None else 0)
            if any(ready[1:]):
                for start, size in bucket_spans(header.total_bytes, header.bucket_bytes):
                    self._bucket(group, assembly, start, size)
                    if verifier is not None:
                        verifier.submit(start, size)
            ok = verifier is not None and verifier.ok()
        except BaseException:
            if verifier is not None:
                verifier.ok()  # no checksum thread may outlive the buffer
            if assembly is not None:
                self._hand_back(assembly, False, "the broadcast round failed", "round_failed")
            raise
        finally:
            self.receiving = 0
            self._scratch = None
        if assembly is not None:  # staged before the last all_gather: a peer failing there
            self._hand_back(assembly, ok, "a bucket failed its checksum",  # cannot cost it
                            "checksum")
        group.all_gather_flags(1 if ok else 0)

    def _verifier(self, assembly: Assembly) -> _Verifier:
        def verified(chunks: range) -> None:  # on the subscriber thread, like fetched chunks
            self.member.call(lambda client: self.member.verified(client, assembly, chunks))
        return _Verifier(assembly, verified)

    def _bucket(self, group: CollectiveGroup, assembly: Assembly | None, start: int,
                size: int) -> None:
        if group.device.type == "cpu":
            if assembly is not None:
                group.broadcast(assembly.buffer[start: start + size])  # straight into staging
            else:
                group.broadcast(self._scratch_of(size))
            return
        with group.on_stream():  # the group's stream, not the engine's
            if self._bounce is None or self._bounce.numel() < size:  # the first is a full one
                self._bounce = torch.empty(size, dtype=torch.uint8, device=group.device)
            bucket = self._bounce[:size]
        group.broadcast(bucket)
        if assembly is not None:
            with group.on_stream():
                assembly.buffer[start: start + size].copy_(bucket)  # D2H, waits for this stream

    def _scratch_of(self, size: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8)
        return self._scratch[:size]

    def _hand_back(self, assembly: Assembly, ok: bool, why: str, cause: str) -> None:
        version = assembly.manifest.version
        if ok:
            self.member.call(lambda client: self.member.finish(
                client, assembly, assembly.manifest.total_bytes))
        else:
            self.member.call(lambda client: self.member.failed(client, version, assembly, why,
                                                               cause))

    # -- cuda_ipc --------------------------------------------------------------------------
    def _copy(self, job: IpcJob) -> None:
        version = job.handle.version
        self.receiving = version
        assembly = self._begin(version, None, job.announce.backend)
        if assembly is None:
            return
        ok, why, cause = False, "a chunk failed its checksum", "checksum"
        verifier = self._verifier(assembly)
        try:
            with side_stream(job.device):  # not the engine's stream (cuda_ipc.py)
                source = open_buffer(job.handle, job.device)
                total = assembly.manifest.total_bytes
                if source.numel() < total:
                    raise TransportError(f"cuda_ipc: version {version} buffer has "
                                         f"{source.numel()} bytes, the manifest {total}")
                for start, size in bucket_spans(total, job.announce.bucket_bytes):
                    assembly.buffer[start: start + size].copy_(source[start: start + size])
                    verifier.submit(start, size)
                del source
            ok = verifier.ok()
        except Exception as exc:
            verifier.ok()
            why, cause = str(exc), "ipc_copy"
            log.warning("cuda_ipc: version %d not copied: %s", version, exc)
        self.member.ipc_done = max(self.member.ipc_done, version)
        self._hand_back(assembly, ok, why, cause)
