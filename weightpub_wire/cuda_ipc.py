"""CUDA IPC handles of a version's device buffer, as plain bytes and integers (no pickle).

Why: a replica colocated on the trainer's GPU (RL with both on one device) can copy
a version straight out of the publisher's device memory instead of receiving it
through host memory and TCP. This is what torch's ``reduce_tensor`` /
``rebuild_cuda_tensor`` do (vLLM's ``ipc`` engine, checkpoint-engine), minus the
pickle: the fields of ``UntypedStorage._share_cuda_()`` travel in an ``IpcHandle``
and ``_new_shared_cuda`` opens them. torch's IPC reference counter keeps the
exporter from reusing the memory while the importer has it open.

Streams: the exporter's copy and the importer's copies run on a side stream of
their own (``side_stream``), never on the process's current stream, where a
trainer's step or a replica's forward is queued: a copy there would wait for
them, and a synchronous one would make this thread wait too. ``_share_cuda_``
records the IPC event on the current stream and ``_new_shared_cuda`` makes the
current stream wait for it, so both are called with the side stream current.

Size: with ``expandable_segments`` a handle carries one shareable handle per
segment of the buffer (``collective_layout.ipc_handle_limit``), not 64 bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from weightpub_wire.collective_layout import IpcHandle
from weightpub_wire.errors import TransportError

__all__ = ["device_uuid", "export_buffer", "open_buffer", "side_stream"]

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """``device`` and one side stream of it (made once per device) as current."""
    if device.type != "cuda":
        yield None
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        yield stream


def device_uuid(device: torch.device | int | None = None) -> str:
    """The physical GPU's UUID (what two processes compare to know they share a device)."""
    if not torch.cuda.is_available():
        return ""
    if isinstance(device, int):
        index = device
    elif device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    return str(torch.cuda.get_device_properties(index).uuid)


def export_buffer(buffer: torch.Tensor, version: int) -> IpcHandle:
    """An ``IpcHandle`` of a flat uint8 CUDA tensor that starts its storage."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransportError("cuda_ipc: only a flat uint8 CUDA buffer can be shared")
    if buffer.storage_offset() != 0:
        raise TransportError("cuda_ipc: the shared buffer must start its storage")
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync) = buffer.untyped_storage()._share_cuda_()
    try:
        return IpcHandle(version=version, device_index=int(device), handle=bytes(handle),
                         storage_bytes=int(storage_bytes), storage_offset=int(storage_offset),
                         ref_counter_handle=bytes(ref_handle),
                         ref_counter_offset=int(ref_offset),
                         event_handle=bytes(event_handle or b""),
                         event_sync_required=bool(event_sync))
    except ValueError as exc:  # torch made a handle our wire bounds do not allow
        raise TransportError(f"cuda_ipc: version {version}: {exc}") from exc


def open_buffer(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """The exporter's buffer, mapped into this process on ``device`` (same physical GPU)."""
    if device.type != "cuda":
        raise TransportError("cuda_ipc: this process has no CUDA device")
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(),
            handle.handle, handle.storage_bytes, handle.storage_offset,
            handle.ref_counter_handle, handle.ref_counter_offset,
            handle.event_handle or None, handle.event_sync_required)
    except Exception as exc:
        raise TransportError(f"cuda_ipc: cannot open the handle of version {handle.version}: "
                             f"{type(exc).__name__}: {exc}") from exc
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (handle.storage_bytes,), (1,))
