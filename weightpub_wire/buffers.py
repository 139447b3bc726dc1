"""Flat byte buffers: one pool both sides recycle, and zero-copy views of them.

Why a pool: fresh host memory costs a page fault per 4 KiB (about 0.5 s/GB
here), so a publisher's snapshot buffers and a subscriber's staging buffers
are reused from one version to the next.

Why a budget: a subscriber stages whole versions in host memory, several at a
time (one arriving, the ones its consumer still holds). A pool with
``budget_bytes`` counts every buffer it made that is still alive (handed out
or kept for reuse) and refuses, before allocating, a buffer that would take it
past the budget: ``room_for`` says whether to wait (the consumer still holds
buffers that will come back) or raises ``StagingBudgetError`` (never fits).

Where the memory comes from is the allocator's business: ``HostAllocator``
(plain or pinned host memory, the default) or a shared-memory allocator
(``subscriber_ext.transport.node.shared_segments``) whose buffers other processes map.

Why pinned memory is not ``torch.empty(pin_memory=True)``: torch's caching host
allocator rounds every pinned allocation up to a power of two and keeps the block
cached, page-locked, after it is freed (``ATen/core/CachingHostAllocator.h``,
torch 2.13: ``PowerOf2Ceil`` unless ``pinned_max_round_threshold`` is configured):
a 16.1 GB version pins 32 GiB that no budget sees, for the life of the process.
``page_locked`` pins exactly the bytes of a mapping with ``cudaHostRegister`` and
unregisters them when the last view of the memory is gone. Unlike torch's pinned
blocks, no event recorded by an asynchronous copy keeps such a buffer from being
reused: whoever copies out of a staged buffer with ``non_blocking=True`` waits for
that copy before releasing the buffer (``subscriber_ext/vllm_ext/apply/streams.py`` does).

Sends without a copy: a peer-sharing subscriber hands staging bytes to ZeroMQ in place
(``copy=False``), and ZeroMQ reads them later, from its I/O thread. ``send_begin``
counts such a send against the buffer, ``send_end`` once ZeroMQ let go of it. A buffer
given back (or forgotten, or dropped) while sends are counted is *draining*: still
counted against the budget, never handed out, released or unmapped until its last
send ended; then it goes where it was going (kept for reuse or released). So a newer
version never lands in bytes still on their way to a peer, and the budget counts
each buffer once, as long as it lives. The sender bounds the wait: a reader that
does not read is cut (``subscriber_ext/transport/peers/peer_server.py``).

Bytes beside the buffers: memory a caller keeps of its own next to the staged versions (a
peer server's cache of gathered slices, ``subscriber_ext/transport/peers/slice_cache.py``;
a stream source's scratch, ``subscriber_ext/transport/client/stream_source.py``) is counted
against the same budget with ``hold``/``unhold`` (``held_bytes`` includes it;
``side_bytes`` says how much). ``hold`` refuses what does not fit instead of waiting, and
``room_for`` calls each holder's shedder (``on_shed``: it gives its bytes back) before a
version would have to wait for them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy
import torch

from weightpub_wire.errors import StagingBudgetError

__all__ = ["Allocator", "BufferPool", "HostAllocator", "Register", "Unregister", "byte_view",
           "copy_bytes", "cuda_host_register", "cuda_host_unregister", "flat_bytes",
           "page_locked"]

log = logging.getLogger("weightpub.buffers")

Register = Callable[[int, int], None]  # (address, bytes): page-lock them
Unregister = Callable[[int], None]  # (address): undo a Register


def cuda_host_register(address: int, nbytes: int) -> None:
    """``cudaHostRegister`` (portable: every CUDA context may use the memory)."""
    status = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {status})")


def cuda_host_unregister(address: int) -> None:
    status = int(torch.cuda.cudart().cudaHostUnregister(address))
    if status != 0:
        raise RuntimeError(f"cudaHostUnregister failed (cudaError {status})")


def page_locked(mapping: mmap.mmap, nbytes: int, register: Register = cuda_host_register,
                unregister: Unregister = cuda_host_unregister) -> torch.Tensor:
    """A flat uint8 tensor over ``mapping``'s first ``nbytes``, page-locked while it lives.

    The tensor holds a numpy array that holds the mapping: the array's weak-reference
    callbacks run before it releases the mapping, so the memory is unregistered when
    the last view of it is gone and before it is unmapped.
    """
    array = numpy.frombuffer(mapping, dtype=numpy.uint8, count=nbytes)
    tensor = torch.from_numpy(array)
    address = tensor.data_ptr()
    register(address, nbytes)
    weakref.finalize(array, _unregister_quietly, unregister, address, nbytes)
    return tensor


def _unregister_quietly(unregister: Unregister, address: int, nbytes: int) -> None:
    try:
        unregister(address)
    except Exception:  # a finalizer must not raise; the pages stay locked until exit
        log.exception("could not unregister %d page-locked bytes", nbytes)


class Allocator(Protocol):
    """Makes flat uint8 buffers for a ``BufferPool`` and is told when one is dropped."""

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """A new flat uint8 CPU tensor of exactly ``nbytes`` (>= 1)."""
        ...

    def free(self, key: int) -> None:
        """The pool dropped the buffer whose ``data_ptr()`` is ``key``; its memory goes
        once the last view of it is gone."""
        ...


class HostAllocator:
    """Private host memory (pinned on request: host <-> device copies at full PCIe speed).

    Pinned buffers are exactly ``nbytes`` of an anonymous mapping, registered with
    ``register`` and unregistered with ``unregister`` once their last view is gone
    (``page_locked``; CUDA's by default).
    """

    def __init__(self, register: Register = cuda_host_register,
                 unregister: Unregister = cuda_host_unregister) -> None:
        self._register = register
        self._unregister = unregister

    def allocate(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        if not pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        return page_locked(mmap.mmap(-1, nbytes), nbytes, self._register, self._unregister)

    def free(self, key: int) -> None:
        return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


class BufferPool:
    """Keeps up to ``max_buffers`` freed flat uint8 buffers and hands out the best fit.

    ``pinned`` (default: whether CUDA is available) pins new buffers so host <->
    device copies run at full PCIe speed; ``take(..., pinned=)`` overrides it.
    Page-locked memory cannot be swapped or reclaimed, so a buffer larger than
    ``max_pinned_bytes`` is never pinned (a peer announcing a huge version gets,
    at most, pageable memory within the receiver's ``Limits``).
    ``budget_bytes`` (None: unlimited) bounds the bytes of all live buffers.
    """

    def __init__(self, max_buffers: int = 2, *, pinned: bool | None = None,
                 max_pinned_bytes: int | None = None, allocator: Allocator | None = None,
                 budget_bytes: int | None = None,
                 budget_name: str = "staging_budget_bytes",
                 outside: Callable[[], int] | None = None) -> None:
        """``outside``: bytes held beside this pool's buffers that count against the same
        budget (a publisher's reply scratch); ``room_for`` leaves room for them."""
        self._outside = outside
        self._free: list[torch.Tensor] = []
        self._max = max_buffers
        self._pinned = torch.cuda.is_available() if pinned is None else pinned
        self.max_pinned_bytes = max_pinned_bytes
        self._allocator: Allocator = allocator or HostAllocator()
        self.budget_bytes = budget_bytes
        self._budget_name = budget_name
        self._out: dict[int, int] = {}  # data_ptr -> bytes, handed out and not given back
        self._pinned_keys: set[int] = set()  # data_ptr of each live buffer made pinned
        #: data_ptr -> reuse key of each live sparse buffer; idle ones by key (bytes counted)
        self._sparse: dict[int, object] = {}
        self._sparse_free: dict[object, tuple[torch.Tensor, int]] = {}
        #: data_ptr -> sends ZeroMQ holds without a copy (``send_begin``/``send_end``)
        self._sending: dict[int, int] = {}
        #: data_ptr -> (buffer, bytes): given back (buffer) or forgotten (None) while sends
        #: were counted; counted as held, never handed out, until the last one ends
        self._draining: dict[int, tuple[torch.Tensor | None, int]] = {}
        self._side = 0  # bytes held beside the buffers (``hold``)
        #: give the bytes beside the buffers back (``unhold``) when a buffer needs the room;
        #: called by ``room_for``, on the thread that calls it (``on_shed``)
        self._shedders: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    # -- accounting ------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes of every live buffer of this pool: handed out, or kept for reuse."""
        with self._lock:
            return self._held_locked()

    def _held_locked(self) -> int:
        return sum(self._out.values()) + sum(b.numel() for b in self._free) + \
            sum(counted for _, counted in self._sparse_free.values()) + \
            sum(nbytes for _, nbytes in self._draining.values()) + self._side

    # -- bytes beside the buffers ----------------------------------------------------------
    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` the caller keeps beside the buffers against the budget; False
        (nothing counted) when they do not fit now."""
        if nbytes < 0:
            raise ValueError(f"hold: {nbytes} bytes")
        with self._lock:
            if self.budget_bytes is not None and \
                    self._held_locked() + nbytes > self.budget_bytes:
                return False
            self._side += nbytes
            return True

    def unhold(self, nbytes: int) -> None:
        """``nbytes`` counted by ``hold`` are given back."""
        with self._lock:
            if not 0 <= nbytes <= self._side:
                raise ValueError(f"unhold: {nbytes} bytes, {self._side} held")
            self._side -= nbytes

    def on_shed(self, shedder: Callable[[], None]) -> None:
        """``shedder()`` gives back what its holder counted with ``hold`` when a buffer
        needs the room (``room_for``, on the thread calling it)."""
        self._shedders.append(shedder)

    def off_shed(self, shedder: Callable[[], None]) -> None:
        """``shedder`` is called no more (its holder is closing)."""
        if shedder in self._shedders:
            self._shedders.remove(shedder)

    @property
    def side_bytes(self) -> int:
        """Bytes counted by ``hold`` and not given back (included in ``held_bytes``)."""
        with self._lock:
            return self._side

    # -- sends without a copy --------------------------------------------------------------
    def send_begin(self, buf: torch.Tensor) -> int:
        """Count a send of bytes of ``buf`` (a view of a buffer from ``take``) that ZeroMQ
        reads in place; the key to pass to ``send_end``."""
        key = _key(buf)
        with self._lock:
            self._sending[key] = self._sending.get(key, 0) + 1
        return key

    def send_end(self, key: int) -> None:
        """ZeroMQ let go of a send counted by ``send_begin``: a draining buffer whose last
        send this was goes where it was going."""
        with self._lock:
            left = self._sending.get(key, 0) - 1
            if left > 0:
                self._sending[key] = left
                return
            self._sending.pop(key, None)
            drained = self._draining.pop(key, None)
            if drained is None:
                return
            buffer, _ = drained
            keep = buffer is not None and len(self._free) < self._max
            if keep:
                assert buffer is not None
                self._free.append(buffer)
        if not keep:
            self._release(key)

    def draining(self, key: int) -> bool:
        """Whether the buffer ``key`` waits for its sends to end before it can be reused."""
        with self._lock:
            return key in self._draining

    @property
    def sends_in_flight(self) -> int:
        """Sends ZeroMQ holds without a copy, over every buffer (tests, status)."""
        with self._lock:
            return sum(self._sending.values())

    @property
    def draining_bytes(self) -> int:
        """Bytes of buffers waiting for their sends to end (counted in ``held_bytes``)."""
        with self._lock:
            return sum(nbytes for _, nbytes in self._draining.values())

    def room_for(self, nbytes: int) -> bool:
        """Whether ``take(nbytes)`` fits the budget now (dropping idle buffers if needed).

        Raises ``StagingBudgetError`` when ``nbytes`` alone exceeds the budget; returns
        False when it fits only once handed-out buffers come back.
        """
        budget = self.budget_bytes
        if budget is None:
            return True
        if nbytes > budget:
            raise StagingBudgetError(
                f"{nbytes} bytes ({_gib(nbytes)}) of staging needed, more than the budget "
                f"of {budget} bytes ({_gib(budget)}; {self._budget_name})")
        outside = 0 if self._outside is None else self._outside()
        with self._lock:
            if self._best_free_locked(nbytes, self.will_pin(nbytes)) is not None:
                return True
            shed = list(self._shedders) if self._side and \
                self._held_locked() + outside + nbytes > budget else []
        for shedder in shed:
            shedder()  # bytes beside the buffers go before idle buffers do
        dropped: list[int] = []
        with self._lock:
            self._free.sort(key=lambda b: b.numel())
            while self._sparse_free and self._held_locked() + outside + nbytes > budget:
                key = next(iter(self._sparse_free))
                dropped.append(self._sparse_free.pop(key)[0].data_ptr())
            while self._free and self._held_locked() + outside + nbytes > budget:
                dropped.append(self._free.pop().data_ptr())  # the largest idle one first
            fits = self._held_locked() + outside + nbytes <= budget
        for key in dropped:
            self._release(key)
        return fits

    # -- take and give ---------------------------------------------------------------------
    def will_pin(self, nbytes: int, pinned: bool | None = None) -> bool:
        """Whether ``take(nbytes, pinned=pinned)`` returns page-locked memory."""
        pin = self._pinned if pinned is None else pinned
        return pin and (self.max_pinned_bytes is None or nbytes <= self.max_pinned_bytes)

    def _best_free_locked(self, nbytes: int, pin: bool) -> int | None:
        best = None
        for index, buf in enumerate(self._free):
            if buf.numel() >= nbytes and (buf.data_ptr() in self._pinned_keys) == pin and (
                    best is None or buf.numel() < self._free[best].numel()):
                best = index
        return best

    def take(self, nbytes: int, *, pinned: bool | None = None) -> torch.Tensor:
        """A flat uint8 buffer of exactly ``nbytes`` (a view of a maybe larger one).

        With a budget, raises ``StagingBudgetError`` instead of allocating past it
        (call ``room_for`` first to tell waiting from never).
        """
        pin = self.will_pin(nbytes, pinned)
        with self._lock:
            best = self._best_free_locked(nbytes, pin)
            if best is not None:
                buf = self._free.pop(best)
                self._out[buf.data_ptr()] = buf.numel()
                return buf[:nbytes]
            size = max(nbytes, 1)
            if self.budget_bytes is not None and \
                    self._held_locked() + size > self.budget_bytes:
                raise StagingBudgetError(
                    f"{size} bytes of staging needed but {self._held_locked()} of the "
                    f"{self.budget_bytes}-byte budget are in use ({self._budget_name})")
        buf = self._allocator.allocate(size, pinned=pin)
        with self._lock:
            self._out[buf.data_ptr()] = buf.numel()
            if pin:
                self._pinned_keys.add(buf.data_ptr())
        return buf[:nbytes]

    def take_sparse(self, nbytes: int, counted: int, key: object = None) -> torch.Tensor:
        """A zeroed flat buffer of ``nbytes`` of which only about ``counted`` bytes will be
        written (a slice plan's: issue 30), counted as ``counted`` against the budget.

        Anonymous memory: pages never written cost nothing, so a rank staging its slices
        of a version holds about its share. Never pinned (page-locking would make every
        page resident). Reused only for the same ``key`` (a plan in one layout: the same
        bytes are written again, every other byte is still zero); without a key, or once
        ``max_buffers`` others are idle, ``give`` frees it.
        """
        with self._lock:
            idle = self._sparse_free.pop(key, None) if key is not None else None
            if idle is not None:
                buf = idle[0]
                self._out[buf.data_ptr()] = counted
                self._sparse[buf.data_ptr()] = key
                return buf[:nbytes]
            if self.budget_bytes is not None and \
                    self._held_locked() + counted > self.budget_bytes:
                raise StagingBudgetError(
                    f"{counted} bytes of sparse staging needed but {self._held_locked()} of "
                    f"the {self.budget_bytes}-byte budget are in use ({self._budget_name})")
        buf = torch.from_numpy(numpy.frombuffer(mmap.mmap(-1, max(nbytes, 1)),
                                                dtype=numpy.uint8))
        with self._lock:
            self._out[buf.data_ptr()] = counted
            self._sparse[buf.data_ptr()] = key
        return buf[:nbytes]

    def _release(self, key: int) -> None:
        with self._lock:
            self._pinned_keys.discard(key)
        self._allocator.free(key)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` (its whole allocation is kept); one with sends
        in flight drains first (``send_begin``)."""
        base = buf if buf._base is None else buf._base
        key = base.data_ptr()
        with self._lock:
            counted = self._out.pop(key, 0)
            if key in self._sparse:  # never sent without a copy (a plan refuses peers)
                reuse = self._sparse.pop(key)
                if reuse is not None and len(self._sparse_free) < self._max:
                    self._sparse_free.pop(reuse, None)
                    self._sparse_free[reuse] = (base, counted)
                return  # else freed with its last view
            if any(b is base for b in self._free) or key in self._draining:
                return
            if self._sending.get(key):
                self._draining[key] = (base, base.numel())
                return
            keep = len(self._free) < self._max
            if keep:
                self._free.append(base)
        if not keep:
            self._release(key)

    def forget(self, key: int) -> None:
        """A handed-out buffer (``data_ptr()`` ``key``) will never come back: stop counting
        it. Its memory is freed by whoever still holds views of it."""
        with self._lock:
            nbytes = self._out.pop(key, None)
            self._sparse.pop(key, None)
            if nbytes is not None and self._sending.get(key):
                self._draining[key] = (None, nbytes)  # still counted until sent
                return
        if nbytes is not None:
            self._release(key)


def _key(buf: torch.Tensor) -> int:
    """The pool's key of a buffer: its whole allocation's ``data_ptr``."""
    return (buf if buf._base is None else buf._base).data_ptr()


def byte_view(buffer: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A memoryview of a flat uint8 CPU tensor (empty when ``nbytes`` is 0), no copy."""
    if nbytes == 0 or buffer.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, buffer.numpy()))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view (0-d included), no copy."""
    return (tensor.reshape(-1) if tensor.dim() else tensor.reshape(1)).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one flat uint8 CPU tensor into another of the same size: one plain memcpy.

    Why not ``dst.copy_(src)``: torch splits a large copy across its OpenMP threads,
    which spin while waiting for each other; next to ZeroMQ's I/O threads, hashing and
    a receiver on a few cores that made the snapshot copy several times slower (see
    docs/benchmarks.md). ``ctypes.memmove`` is one thread and releases the GIL.
    """
    if dst.numel() != src.numel():
        raise ValueError(f"copy_bytes: {src.numel()} bytes into {dst.numel()}")
    if dst.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())
