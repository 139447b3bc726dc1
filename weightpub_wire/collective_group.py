"""One collective group (gloo on CPUs, NCCL on GPUs) where no wait can hang.

Why not ``torch.distributed.init_process_group``: a trainer and the replicas'
node owners are not one job; a group is formed and torn down many times while
both keep running (replicas join, leave, die), so it must not touch torch's
global state. As vLLM's ``stateless_init_torch_distributed_process_group`` does,
a group is a backend object built straight on a ``TCPStore`` (one per publisher,
``Rendezvous``), under a ``PrefixStore`` per epoch so a late member of an old
epoch can never mix into a new one.

An NCCL group is two groups: the data (buckets, device tensors) goes over NCCL,
the control (round headers, ready / verified flags: CPU tensors) over a gloo
group on the same store. A member waiting for the next header then blocks in a
socket read, not in an NCCL kernel spinning on its GPU while the host polls it
(the receiver waits for a header most of its life), and the small flags never
race a device fill (docs/RELIABILITY.md, "GPU findings").

Every wait is bounded:

* the rendezvous (store connect, every rank arriving) by ``timeout``: gloo's
  full mesh is formed in its constructor; NCCL's communicator is formed by a
  probe all-reduce on a helper thread the caller waits for, bounded, after the
  gloo control group proved every rank arrived;
* gloo operations by the group's own timeout (a dead peer is noticed at once: its
  sockets reset), NCCL operations by polling the work until a deadline and then
  aborting the communicator.

A dying peer must never take this process down: torch's NCCL watchdog, by
default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), rethrows a communicator error on
its own thread, which terminates the process, and its heartbeat monitor kills the
process on a flight-recorder dump signal another rank writes into the shared
store. ``nccl_environment()`` is what every ``ProcessGroupNCCL`` here is built
under (torch reads these variables in the constructor): clean up only, no
monitor, no dump signal, no error propagation.

Any failure raises ``GroupError`` and leaves the group unusable: the caller tears
it down and falls back (the subscriber fetches the version over ZeroMQ frames).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.errors import TransportError

__all__ = ["CollectiveGroup", "GroupError", "Rendezvous", "arrived_ranks", "connect_store",
           "bounded_start", "local_address_towards", "nccl_environment",
           "scoped_environment", "stuck_rendezvous"]

log = logging.getLogger("weightpub.collective")

_WATCHDOG = timedelta(days=1)  # NCCL: our own deadline aborts first
_POLL_S = 0.0005
_ABORT_WAIT_S = 5.0  # an abort that does not return in this time is left to its thread

#: torch's ``ProcessGroupNCCL`` reads these in its constructor
#: (torch/csrc/distributed/c10d/ProcessGroupNCCL.{hpp,cpp}, torch 2.13):
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 2 (CleanUpOnly) aborts the communicators on
#: an error and never rethrows on the watchdog thread (1 TearDown and 3 SkipCleanUp,
#: the default, do: ``std::terminate``); the heartbeat monitor is off (it calls
#: ``terminateProcess`` on a dump signal or a stuck watchdog); no flight-recorder
#: dump signal written to, or polled from, the store every epoch shares; no error
#: propagated through it; no blocking wait (we poll the work ourselves); no desync
#: debug (it would force SkipCleanUp back on with NoHandling).
_NCCL_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_DESYNC_DEBUG": "0",
}
_ENV_LOCK = threading.Lock()
_stuck_lock = threading.Lock()
_stuck = 0  # NCCL rendezvous threads still inside ncclCommInitRank after their deadline


def nccl_environment() -> dict[str, str]:
    """The environment every ``ProcessGroupNCCL`` of this module is constructed under."""
    return dict(_NCCL_ENV)


@contextlib.contextmanager
def scoped_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, then exactly what was there before.

    Why scoped: the trainer's own process groups keep the user's settings; only the
    constructor that runs inside the block reads ours. One block at a time.
    """
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def stuck_rendezvous() -> int:
    """NCCL rendezvous threads abandoned after their deadline (each holds a half-formed
    communicator until NCCL gives up; see ``CollectiveGroup``)."""
    return _stuck


class GroupError(TransportError):
    """A rendezvous or collective failed or timed out; the group is unusable."""


def local_address_towards(host: str, port: int) -> str:
    """The local IP address a connection to ``host`` leaves from (the fabric we share)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # no packet is sent: this only asks the routing table
        return str(probe.getsockname()[0])


class Rendezvous:
    """The publisher's ``TCPStore``, bound on ``host`` (never on every interface)."""

    def __init__(self, host: str, port: int = 0, *, timeout: float = 30.0) -> None:
        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
            self._listener.listen(256)
        except OSError as exc:
            self._listener.close()
            raise TransportError(f"collective rendezvous: cannot bind {host}:{port} "
                                 f"({exc.strerror})") from exc
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        try:
            self.store: Any = TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout),
                                       master_listen_fd=self._listener.fileno())
        except BaseException:
            self._listener.close()
            raise
        self._listener.detach()  # the store owns (and closes) the descriptor now

    def close(self) -> None:
        self.store = None  # the server stops once the last reference goes


def connect_store(host: str, port: int, timeout: float) -> Any:
    """A client of a publisher's rendezvous; ``GroupError`` if it does not answer in time."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout))
    except Exception as exc:  # DistNetworkError, RuntimeError: the store is unreachable
        raise GroupError(f"collective rendezvous {host}:{port} unreachable within "
                         f"{timeout}s: {_short(exc)}") from exc


def arrived_ranks(store: Any, prefix: str, world_size: int) -> list[int]:
    """Ranks that reached an epoch's rendezvous (the publisher asks after a failed one)."""
    from torch.distributed import PrefixStore

    scoped = PrefixStore(prefix, store)
    out = []
    for rank in range(world_size):
        with contextlib.suppress(Exception):
            if scoped.check([f"arrived/{rank}"]):
                out.append(rank)
    return out


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


class CollectiveGroup:
    """Rank ``rank`` of ``world_size`` in one epoch's group; the publisher is rank 0.

    ``broadcast`` sends a device tensor over the data group (NCCL) and a CPU tensor
    over the control group (gloo; the same group when the backend is gloo).
    On CUDA every device operation of the group runs on its own stream
    (``on_stream()``: callers' copies into and out of the device buckets too), so
    nothing waits behind, or makes wait, the kernels of the process's other streams
    (a trainer's step, a replica's forward), and nothing the collective reads is
    written on a stream it does not wait for.
    """

    def __init__(self, backend: str, store: Any, prefix: str, rank: int, world_size: int,
                 *, timeout: float, epoch: int = 0, local_host: str | None = None,
                 device: torch.device | None = None) -> None:
        from torch.distributed import PrefixStore

        self.backend = backend
        self.spec = spec = collective_backend(backend, error=GroupError)
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.device = (device or spec.device()) if spec.needs_cuda else spec.device()
        self._store = PrefixStore(prefix, store)
        self._closed = False
        self._broken: str | None = None
        self._stream: Any = None
        self._ctl: Any = None
        try:
            self._store.set(f"arrived/{rank}", "1")  # who made it, if the rendezvous fails
            if not spec.has_group:
                raise GroupError(f"collective backend {backend!r} has no group")
            if not spec.device_group:  # gloo: one group carries buckets and control
                self._pg = self._ctl = self._gloo(self._store, local_host)
            else:
                if not torch.cuda.is_available():
                    raise GroupError(f"{backend}: this process has no CUDA device")
                # gloo's full mesh forms first: every rank has arrived (bounded) before
                # any of them enters ncclCommInitRank, which no deadline can interrupt
                self._ctl = self._gloo(PrefixStore("control", self._store), local_host)
                self._pg = self._nccl()
        except GroupError:
            self._drop_control()
            raise
        except Exception as exc:
            self._drop_control()
            raise GroupError(f"{backend} group rank {rank}/{world_size}: rendezvous failed "
                             f"within {timeout}s: {_short(exc)}") from exc

    # -- construction --------------------------------------------------------------------------
    def _gloo(self, store: Any, local_host: str | None) -> Any:
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=self.timeout)
        options._devices = [ProcessGroupGloo.create_device(hostname=local_host or "")]
        return ProcessGroupGloo(store, self.rank, self.world_size, options)

    def _nccl(self) -> Any:
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(device=self.device)
        options = ProcessGroupNCCL.Options()
        options._timeout = _WATCHDOG
        with scoped_environment(_NCCL_ENV):
            pg: Any = ProcessGroupNCCL(self._store, self.rank, self.world_size, options)
        # NCCL forms its communicator on the first collective: do it now, bounded
        try:
            self._wait(self._rendezvous_probe(pg), "rendezvous", pg)
        except BaseException:
            _abort_in_background(pg)
            raise
        return pg

    def _rendezvous_probe(self, pg: Any) -> Any:
        """The probe all-reduce's work, started on a helper thread (``bounded_start``)."""

        def probe() -> Any:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._stream):
                data = torch.zeros(1, device=self.device)  # on the group's stream
                return pg.allreduce([data])

        return bounded_start(probe, self.timeout, lambda: _abort_in_background(pg),
                             f"nccl rendezvous (rank {self.rank}/{self.world_size})")

    # -- operations ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The group's CUDA stream and device as current (nothing on gloo)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """``tensor`` from ``root`` to every rank, in place: a CPU tensor over the control
        group, a tensor on this group's device over the data group."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        pg = self._ctl if tensor.device.type == "cpu" else self._pg
        self._run(lambda: pg.broadcast([tensor], options), "broadcast",
                  control=tensor.device.type == "cpu")

    def all_gather_flags(self, value: int) -> list[int]:
        """Every rank's small integer (who is ready, who verified), in rank order
        (over the control group: host memory, no device fill to race)."""
        mine = torch.tensor([value], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._run(lambda: self._ctl.allgather([out], [mine]), "all_gather", control=True)
        return [int(t.item()) for t in out]

    def _run(self, start: Callable[[], Any], what: str, *, control: bool = False) -> None:
        if self._closed or self._broken is not None:
            raise GroupError(f"{self.backend} group is {'closed' if self._closed else 'broken'}"
                             f"{'' if self._broken is None else f' ({self._broken})'}")
        try:
            if control:
                work = start()
            else:
                with self.on_stream():
                    work = start()
        except Exception as exc:
            self._broken = _short(exc)
            raise GroupError(f"{self.backend} {what} failed: {self._broken}") from exc
        if control:
            self._wait_gloo(work, what)
        else:
            self._wait(work, what, self._pg)

    def _wait_gloo(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:
            self._broken = _short(exc)
            raise GroupError(f"{self.backend} {what} (rank {self.rank}/{self.world_size}) "
                             f"failed: {self._broken}") from exc

    def _wait(self, work: Any, what: str, pg: Any) -> None:
        if not self.spec.device_group:
            self._wait_gloo(work, what)
            return
        try:
            deadline = time.monotonic() + self.timeout
            while not work.is_completed():  # CUDA: never block the CPU in NCCL
                if time.monotonic() >= deadline:
                    _abort_in_background(pg)
                    raise TimeoutError(f"not done within {self.timeout}s")
                time.sleep(_POLL_S)
            with self.on_stream():
                work.wait()  # the group's stream (not the caller's) waits for NCCL's
            self._stream.synchronize()
        except Exception as exc:
            self._broken = _short(exc)
            raise GroupError(f"{self.backend} {what} (rank {self.rank}/{self.world_size}) "
                             f"failed: {self._broken}") from exc

    def _drop_control(self) -> None:
        ctl, self._ctl = self._ctl, None
        if ctl is not None:
            del ctl
            gc.collect()

    def close(self) -> None:
        """Tear the group down (idempotent); peers still in an operation see it fail."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = getattr(self, "_pg", None), None
        ctl, self._ctl = self._ctl, None
        if pg is not None and self.spec.device_group:
            _abort(pg)
        with contextlib.suppress(Exception):
            self._store.delete_key(f"arrived/{self.rank}")
        del pg, ctl
        gc.collect()  # gloo closes its sockets with the last reference: peers fail at once


def bounded_start(start: Callable[[], Any], timeout: float, abort: Callable[[], Any],
                  what: str) -> Any:
    """``start()``'s result, run on a helper thread the caller waits ``timeout`` for.

    Why: NCCL forms a communicator inside the first collective's launch
    (``ncclCommInitRank``, blocking mode), before any work object exists to poll; a
    rank that never arrives would hold the caller there for ever. On the deadline
    ``abort()`` is called and ``GroupError`` raised; the helper is left behind (NCCL
    offers no way to cancel a blocking init; ``stuck_rendezvous()`` counts them).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = start()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=run, name="weightpub-nccl-rendezvous", daemon=True)
    helper.start()
    helper.join(timeout)
    if helper.is_alive():
        global _stuck
        with _stuck_lock:
            _stuck += 1
        abort()
        raise GroupError(f"{what} not done within {timeout}s (a member that arrived at the "
                         "control group never reached NCCL's)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _abort(pg: Any) -> None:
    """Abort an NCCL group, waiting at most ``_ABORT_WAIT_S`` for it."""
    helper = _abort_in_background(pg)
    helper.join(_ABORT_WAIT_S)
    if helper.is_alive():
        log.warning("collective: an NCCL abort did not return within %ss; left to its "
                    "thread", _ABORT_WAIT_S)


def _abort_in_background(pg: Any) -> threading.Thread:
    def abort() -> None:
        with contextlib.suppress(Exception):
            pg.abort()

    helper = threading.Thread(target=abort, name="weightpub-nccl-abort", daemon=True)
    helper.start()
    return helper
