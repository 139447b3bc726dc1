"""``cuda_ipc``: the newest version in the publisher's GPU memory, shared by CUDA IPC handle.

Why: an RL setup that colocates the trainer and a replica on one GPU cannot use
NCCL (it needs two devices), and sending the weights through host memory and TCP
wastes the fastest link there is. The publisher copies each announced version
once into device memory (one more copy of the weights on the trainer's GPU while
members copy it) and hands its handle to every polling member; a member copies
out bucket by bucket into its staging buffer and verifies the chunks. The copy
runs on a side stream (``cuda_ipc.side_stream``): it never queues behind the
trainer's step, and the handle's IPC event marks its end for the importers.

An old device copy is freed once every live member reports it copied the newest
version (``CollectivePoll.ipc_done``), or ``timeout`` seconds after it was
superseded; torch's IPC reference counter keeps the memory valid for a member
that still has it open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from publisher.collective.collective_members import MemberTable
from publisher.store.version_store import PublishedVersion
from weightpub_wire.cuda_ipc import export_buffer, side_stream

__all__ = ["IpcExporter"]

log = logging.getLogger("weightpub.collective")


@dataclass(slots=True)
class _Shared:
    version: int
    buffer: torch.Tensor
    superseded_at: float | None = None


class IpcExporter:
    """Runs on the collective thread (``run``); ``offer`` from the preparing thread."""

    def __init__(self, table: MemberTable, device: torch.device, timeout: float) -> None:
        self.table = table
        self.device = device
        self.timeout = timeout
        self._cond = threading.Condition()
        self._pending: PublishedVersion | None = None
        self._shared: list[_Shared] = []
        self.exported = 0

    def offer(self, version: PublishedVersion) -> None:
        with self._cond:
            self._pending = version
            self._cond.notify_all()

    def run(self, closed: Callable[[], bool]) -> None:
        while not closed():
            with self._cond:
                self._cond.wait(0.1)
                pending = self._pending
            if pending is not None and self._ready(pending):
                with self._cond:
                    if self._pending is pending:
                        self._pending = None
                try:
                    self._export(pending)
                except Exception:  # members fall back to ZeroMQ frames
                    log.exception("cuda_ipc: cannot share version %d",
                                  pending.manifest.version)
            self._free_done()

    @staticmethod
    def _ready(version: PublishedVersion) -> bool:
        chunks = version.manifest.num_chunks
        return not version.failed and (not chunks or version.chunk_ready(chunks - 1))

    def _export(self, version: PublishedVersion) -> None:
        manifest = version.manifest
        if not manifest.total_bytes:
            return
        if not version.pin(self):  # its buffer already went to a newer snapshot
            return
        try:
            # a side stream: never the trainer's stream, nor a device-wide sync
            with side_stream(self.device) as stream:
                buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8,
                                     device=self.device)
                buffer.copy_(version.buffer[: manifest.total_bytes], non_blocking=True)
                handle = export_buffer(buffer, manifest.version)  # its event: after the copy
                assert stream is not None
                stream.synchronize()  # the host buffer may be reused once this returns
        finally:
            version.unpin(self)
        now = time.monotonic()
        for shared in self._shared:
            shared.superseded_at = shared.superseded_at or now
        self._shared.append(_Shared(manifest.version, buffer))
        self.table.newest_ipc = handle
        self.exported += 1
        log.info("cuda_ipc: version %d shared from %s (%d bytes)", manifest.version,
                 self.device, manifest.total_bytes)

    def _free_done(self) -> None:
        if len(self._shared) < 2:
            return
        newest = self._shared[-1].version
        now = time.monotonic()
        done = self.table.ipc_done(newest, now)
        keep = [s for s in self._shared[:-1]
                if not done and s.superseded_at is not None
                and now - s.superseded_at < self.timeout]
        self._shared = [*keep, self._shared[-1]]

    def close(self) -> None:
        self.table.newest_ipc = None
        self._shared.clear()
