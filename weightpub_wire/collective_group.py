"""One collective group (gloo on CPUs, NCCL on GPUs) where no wait can hang.

Why not ``torch.distributed.init_process_group``: a trainer and the replicas'
node owners are not one job; a group is formed and torn down many times while
both keep running (replicas join, leave, die), so it must not touch torch's
global state. As vLLM's ``stateless_init_torch_distributed_process_group`` does,
a group is a backend object built straight on a ``TCPStore`` (one per publisher,
``Rendezvous``), under a ``PrefixStore`` per epoch so a late member of an old
epoch can never mix into a new one.

Every wait is bounded:

* the rendezvous (store connect, every rank arriving) by ``timeout``;
* gloo operations by the group's own timeout (a dead peer is noticed at once: its
  sockets reset), NCCL operations by polling the work until a deadline and then
  aborting the communicator; torch's NCCL watchdog is given a far longer timeout
  so it never takes the process down instead (``TORCH_NCCL_ASYNC_ERROR_HANDLING``).

Any failure raises ``GroupError`` and leaves the group unusable: the caller tears
it down and falls back (the subscriber fetches the version over ZeroMQ frames).
"""

from __future__ import annotations

import contextlib
import gc
import socket
import time
from datetime import timedelta
from typing import Any

import torch

from weightpub_wire.errors import TransportError

__all__ = ["CollectiveGroup", "GroupError", "Rendezvous", "arrived_ranks", "connect_store",
           "local_address_towards"]

_WATCHDOG = timedelta(days=1)  # NCCL: our own deadline aborts first
_POLL_S = 0.0005


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
    """Rank ``rank`` of ``world_size`` in one epoch's group; the publisher is rank 0."""

    def __init__(self, backend: str, store: Any, prefix: str, rank: int, world_size: int,
                 *, timeout: float, epoch: int = 0, local_host: str | None = None,
                 device: torch.device | None = None) -> None:
        from torch.distributed import PrefixStore

        self.backend = backend
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.device = torch.device("cpu") if backend == "gloo" else (
            device or torch.device("cuda", torch.cuda.current_device()))
        self._store = PrefixStore(prefix, store)
        self._closed = False
        self._broken: str | None = None
        self._stream: Any = None
        try:
            self._store.set(f"arrived/{rank}", "1")  # who made it, if the rendezvous fails
            if backend == "gloo":
                self._pg = self._gloo(local_host)
            elif backend == "nccl":
                self._pg = self._nccl()
            else:
                raise GroupError(f"collective backend {backend!r} has no group")
        except GroupError:
            raise
        except Exception as exc:
            raise GroupError(f"{backend} group rank {rank}/{world_size}: rendezvous failed "
                             f"within {timeout}s: {_short(exc)}") from exc

    # -- construction --------------------------------------------------------------------------
    def _gloo(self, local_host: str | None) -> Any:
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timedelta(seconds=self.timeout)
        options._devices = [ProcessGroupGloo.create_device(hostname=local_host or "")]
        return ProcessGroupGloo(self._store, self.rank, self.world_size, options)

    def _nccl(self) -> Any:
        if not torch.cuda.is_available():
            raise GroupError("nccl: this process has no CUDA device")
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = _WATCHDOG
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(device=self.device)
        pg: Any = ProcessGroupNCCL(self._store, self.rank, self.world_size, options)
        # NCCL forms its communicator on the first collective: do it now, bounded
        probe = torch.zeros(1, device=self.device)
        self._wait(self._launch(lambda: pg.allreduce([probe])), "rendezvous", pg)
        return pg

    # -- operations ----------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """``tensor`` (on this group's device) from ``root`` to every rank, in place."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._run(lambda: self._pg.broadcast([tensor], options), "broadcast")

    def all_gather_flags(self, value: int) -> list[int]:
        """Every rank's small integer (who is ready, who verified), in rank order."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.zeros(1, dtype=torch.int64, device=self.device)
               for _ in range(self.world_size)]
        self._run(lambda: self._pg.allgather([out], [mine]), "all_gather")
        return [int(t.item()) for t in out]

    def _launch(self, start: Any) -> Any:
        if self._stream is None:
            return start()
        with torch.cuda.stream(self._stream):
            return start()

    def _run(self, start: Any, what: str) -> None:
        if self._closed or self._broken is not None:
            raise GroupError(f"{self.backend} group is {'closed' if self._closed else 'broken'}"
                             f"{'' if self._broken is None else f' ({self._broken})'}")
        try:
            work = self._launch(start)
        except Exception as exc:
            self._broken = _short(exc)
            raise GroupError(f"{self.backend} {what} failed: {self._broken}") from exc
        self._wait(work, what, self._pg)

    def _wait(self, work: Any, what: str, pg: Any) -> None:
        try:
            if self.backend == "gloo":
                work.wait(timedelta(seconds=self.timeout))
                return
            deadline = time.monotonic() + self.timeout
            while not work.is_completed():  # CUDA: never block the CPU in NCCL
                if time.monotonic() >= deadline:
                    with contextlib.suppress(Exception):
                        pg.abort()
                    raise TimeoutError(f"not done within {self.timeout}s")
                time.sleep(_POLL_S)
            work.wait()
            if self._stream is not None:
                self._stream.synchronize()
        except Exception as exc:
            self._broken = _short(exc)
            raise GroupError(f"{self.backend} {what} (rank {self.rank}/{self.world_size}) "
                             f"failed: {self._broken}") from exc

    def close(self) -> None:
        """Tear the group down (idempotent); peers still in an operation see it fail."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        with contextlib.suppress(Exception):
            self._store.delete_key(f"arrived/{self.rank}")
        del pg
        gc.collect()  # gloo closes its sockets with the last reference: peers fail at once
