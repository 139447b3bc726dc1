"""The collective path's backends: what each one needs, in one small object per name.

Why a registry: "does this backend need a GPU, a rendezvous, the publisher's
very GPU?" used to be answered by comparing names in a dozen places on both
sides; a new backend (a NIXL path, issue 31) would have added a branch to each.
Now both sides look a name up once (``collective_backend``) and ask the object:

- ``needs_cuda``: both ends need a CUDA device (NCCL, CUDA IPC);
- ``group``: the ``torch.distributed`` group that carries the buckets ("gloo",
  "nccl"), made by ``collective_group.CollectiveGroup`` on a rendezvous; None
  when there is no group at all (``cuda_ipc``: the version is shared by an IPC
  handle handed out in the poll replies, so no rendezvous port either);
- ``same_gpu``: the subscriber must run on the publisher's own GPU (the IPC
  handle opens only there), so polls carry the device's UUID.

Backends register lazily, by name and a loader (as vLLM's
``weight_transfer/factory.py`` does): nothing is built until a name is looked
up, and a wrong name gets an error listing every known one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightpub_wire.errors import ConfigError

__all__ = ["CollectiveBackend", "collective_backend", "known_backends", "register_backend"]


@dataclass(frozen=True, slots=True)
class CollectiveBackend:
    """What one collective backend needs (see the module text)."""

    name: str
    needs_cuda: bool
    group: str | None  # "gloo" | "nccl": the group carrying the buckets; None: no group
    same_gpu: bool = False

    @property
    def has_group(self) -> bool:
        """Whether members form a group at a rendezvous (``store_port``, epochs, rounds)."""
        return self.group is not None

    @property
    def device_group(self) -> bool:
        """Whether its group lives on the device (NCCL): a gloo control group forms
        beside it first (bounding the rendezvous, carrying CPU messages), its waits poll
        instead of blocking, and it is aborted on close. False for a CPU group (gloo:
        one group carries both) and for no group."""
        return self.group is not None and self.needs_cuda

    def device(self, requested: str | None = None) -> Any:
        """The ``torch.device`` its bytes move through: ``requested``, else the current
        CUDA device for a CUDA backend, else the CPU (torch imported only here)."""
        import torch

        if requested:
            return torch.device(requested)
        if self.needs_cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_LOADERS: dict[str, Callable[[], CollectiveBackend]] = {}
_LOADED: dict[str, CollectiveBackend] = {}


def register_backend(name: str, loader: Callable[[], CollectiveBackend]) -> None:
    """Make ``name`` known; ``loader()`` builds its object on the first look-up."""
    if name in _LOADERS:
        raise ConfigError(f"collective backend {name!r} is already registered")
    _LOADERS[name] = loader


def known_backends() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    return tuple(_LOADERS)


def collective_backend(name: str, *, error: type[Exception] = ConfigError) -> CollectiveBackend:
    """The backend called ``name``; ``error`` (a ``ConfigError`` by default) naming it and
    every known backend when there is none."""
    backend = _LOADED.get(name)
    if backend is not None:
        return backend
    loader = _LOADERS.get(name)
    if loader is None:
        raise error(f"unknown collective backend {name!r} (known: "
                    f"{', '.join(known_backends())})")
    backend = _LOADED[name] = loader()
    if backend.name != name:
        raise ConfigError(f"collective backend {name!r}: its loader built {backend.name!r}")
    return backend


register_backend("gloo", lambda: CollectiveBackend("gloo", needs_cuda=False, group="gloo"))
register_backend("nccl", lambda: CollectiveBackend("nccl", needs_cuda=True, group="nccl"))
register_backend("cuda_ipc", lambda: CollectiveBackend("cuda_ipc", needs_cuda=True, group=None,
                                                       same_gpu=True))
