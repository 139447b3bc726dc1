"""Which elements of a published tensor a rank's weight loaders read: recorded, not assumed.

Why: a rank of a TP/EP replica needs a slice of most tensors (its TP shard, its
experts, replicated heads under GQA, a padded vocabulary piece). Only vLLM's own
loaders know which; copying their logic would be wrong for the next model. As
vLLM's ``sharded_rdt`` does, the loaders run once on a stand-in: ``RangeTensor``
has the published tensor's shape and dtype but no bytes. Every view a loader
takes (``narrow``, ``chunk``, ``t``, ``__getitem__``...) is applied to a *meta* view
of the published tensor, so its offset and strides say exactly which source
elements it covers; a copy a loader makes (``contiguous``, ``to``, ``clone``) keeps
the elements; where a reshape must copy, the stand-in switches to carrying the
source indices themselves (``int64``, only the slice's size). ``copy_`` into a
parameter records the covered elements in the ``RangeSink``. Anything else (math
on the weights, ``view(dtype)``) raises ``UnsupportedLoad``: the caller then
needs the whole tensor, never a wrong slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["RangeSink", "RangeTensor", "UnsupportedLoad", "element_runs", "merge_runs"]

#: ops that take a view (the covered elements follow from the result's geometry)
_VIEWS: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.narrow, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.__getitem__,
    torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.transpose, torch.Tensor.t,
    torch.Tensor.permute, torch.Tensor.flatten, torch.Tensor.chunk, torch.Tensor.unbind,
    torch.Tensor.split, torch.Tensor.select, torch.Tensor.expand, torch.Tensor.view_as,
    torch.Tensor.reshape_as, torch.Tensor.movedim, torch.narrow, torch.chunk, torch.split,
    torch.transpose, torch.t, torch.flatten, torch.unbind,
})
#: ops that copy the same elements in the same logical order (dtype may change)
_SAME_ELEMENTS: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.to,
    torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double,
    torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.type_as, torch.Tensor.requires_grad_,
    torch.Tensor.pin_memory,
})


class UnsupportedLoad(NotImplementedError):
    """A loader did something with the weights that is not a view or a plain copy."""


@dataclass
class RangeSink:
    """Where every ``copy_`` from a stand-in lands: source element runs per published name."""

    runs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def record(self, name: str, runs: list[tuple[int, int]]) -> None:
        self.runs.setdefault(name, []).extend(runs)


class RangeTensor(torch.Tensor):
    """A published tensor without bytes; records the elements a loader copies from it."""

    _name: str
    _sink: RangeSink
    _view: torch.Tensor | None  # a meta view of the published tensor (view mode)
    _index: torch.Tensor | None  # the flat source indices, once a reshape had to copy

    @staticmethod
    def __new__(cls: type[RangeTensor], name: str, shape: Sequence[int], dtype: torch.dtype,
                sink: RangeSink, *, view: torch.Tensor | None = None,
                index: torch.Tensor | None = None) -> RangeTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype,
                                                device=torch.device("cpu"),
                                                requires_grad=False)
        t._name = name
        t._sink = sink
        if view is None and index is None:
            view = torch.empty(tuple(shape), dtype=dtype, device="meta")
        t._view = view
        t._index = index
        return t

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"RangeTensor({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    # --------------------------------------------------------------- what it covers
    def covered(self) -> list[tuple[int, int]]:
        """The source element runs ``[start, end)`` this stand-in covers, sorted, merged."""
        if self._index is not None:
            return _index_runs(self._index)
        view = self._view
        assert view is not None
        return element_runs(tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))

    def _child(self, dtype: torch.dtype, *, view: torch.Tensor | None = None,
               index: torch.Tensor | None = None) -> RangeTensor:
        shape = tuple((view if view is not None else index).shape)  # type: ignore[union-attr]
        return RangeTensor(self._name, shape, dtype, self._sink, view=view, index=index)

    def _carrier(self) -> torch.Tensor:
        return self._index if self._index is not None else self._view  # type: ignore[return-value]

    def _as_index(self) -> torch.Tensor:
        """The flat source index of each element of the view (only the view's size)."""
        if self._index is not None:
            return self._index
        view = self._view
        assert view is not None
        index = torch.full(tuple(view.shape), int(view.storage_offset()), dtype=torch.int64)
        for dim, (n, step) in enumerate(zip(view.shape, view.stride(), strict=True)):
            shape = [1] * view.dim()
            shape[dim] = n
            index += torch.arange(n, dtype=torch.int64).view(shape) * step
        return index

    # --------------------------------------------------------------- interception
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            src = args[-1] if func is torch.Tensor.__setitem__ else (
                args[1] if len(args) > 1 else kwargs.get("src"))
            if isinstance(src, RangeTensor):
                return cls._record_copy(func, args, kwargs, src)
        if func is torch.Tensor.view and args and isinstance(args[0], RangeTensor) \
                and any(isinstance(a, torch.dtype) for a in args[1:]):
            raise UnsupportedLoad(f"{args[0]._name!r}: a view as another dtype")
        if func in _VIEWS and args and isinstance(args[0], RangeTensor):
            return cls._view_op(func, args[0], tuple(args[1:]), kwargs)
        if func in _SAME_ELEMENTS and args and isinstance(args[0], RangeTensor):
            me: RangeTensor = args[0]
            return me._child(_dtype_of(me, (*args[1:], *kwargs.values())), view=me._view,
                             index=me._index)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)  # metadata; anything needing bytes is refused below

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
            cls, func: Any, types: Any, args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        names = [a._name for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)]
        raise UnsupportedLoad(f"{func} needs the bytes of {names or '?'}: not a slice")

    @classmethod
    def _view_op(cls, func: Any, me: RangeTensor, rest: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        carrier = me._carrier()
        with torch._C.DisableTorchFunctionSubclass():
            result = func(carrier, *rest, **kwargs)
        if isinstance(result, torch.Tensor):
            return me._wrap(result, func, rest, kwargs)
        if isinstance(result, tuple | list):
            return type(result)(me._wrap(r, func, rest, kwargs) for r in result)
        raise UnsupportedLoad(f"{func} on {me._name!r} returned {type(result).__name__}")

    def _wrap(self, result: torch.Tensor, func: Any, rest: tuple[Any, ...],
              kwargs: dict[str, Any]) -> RangeTensor:
        if self._index is not None:
            return self._child(self.dtype, index=result)
        if result._base is not None or result is self._view:
            return self._child(self.dtype, view=result)
        # a reshape that had to copy: carry the indices it picked
        with torch._C.DisableTorchFunctionSubclass():
            index = func(self._as_index(), *rest, **kwargs)
        if not isinstance(index, torch.Tensor):  # pragma: no cover - same op as above
            raise UnsupportedLoad(f"{func} on {self._name!r}")
        return self._child(self.dtype, index=index)

    @classmethod
    def _record_copy(cls, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                     src: RangeTensor) -> Any:
        dest = args[0]
        if func is torch.Tensor.__setitem__:
            with torch._C.DisableTorchFunctionSubclass():
                target = dest[args[1]]
        else:
            target = dest
        if isinstance(target, torch.Tensor) and target.numel() != src.numel():
            raise UnsupportedLoad(f"{src._name!r}: a broadcasting copy into "
                                  f"{tuple(target.shape)} from {tuple(src.shape)}")
        src._sink.record(src._name, src.covered())
        if isinstance(dest, torch.Tensor) and dest.is_meta and func is torch.Tensor.copy_:
            with torch._C.DisableTorchFunctionSubclass():
                return dest.copy_(torch.empty(tuple(src.shape), dtype=src.dtype,
                                              device="meta"))
        return dest


def _dtype_of(me: RangeTensor, args: Sequence[Any]) -> torch.dtype:
    """The dtype a same-elements copy (``to``, ``float``, ``type_as``...) produces."""
    for arg in args:
        if isinstance(arg, torch.dtype):
            return arg
        if isinstance(arg, torch.Tensor) and not isinstance(arg, RangeTensor):
            return arg.dtype
    return me.dtype


def element_runs(shape: tuple[int, ...], stride: tuple[int, ...],
                 offset: int) -> list[tuple[int, int]]:
    """The flat elements a strided view covers, as sorted, merged ``[start, end)`` runs."""
    if any(n == 0 for n in shape):
        return []
    dims = sorted(((n, s) for n, s in zip(shape, stride, strict=True) if n != 1),
                  key=lambda d: d[1])
    run, i = 1, 0
    while i < len(dims) and dims[i][1] == run:  # innermost dims laid out back to back
        run *= dims[i][0]
        i += 1
    starts = np.array([offset], dtype=np.int64)
    for n, s in dims[i:]:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).ravel()
    starts.sort()
    return merge_runs((int(a), int(a) + run) for a in starts)


def _index_runs(index: torch.Tensor) -> list[tuple[int, int]]:
    flat = np.unique(index.reshape(-1).numpy())
    if flat.size == 0:
        return []
    breaks = np.nonzero(np.diff(flat) != 1)[0] + 1
    firsts = flat[np.concatenate(([0], breaks))]
    lasts = flat[np.concatenate((breaks - 1, [flat.size - 1]))]
    return [(int(a), int(b) + 1) for a, b in zip(firsts, lasts, strict=True)]


def merge_runs(runs: Any) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ``[start, end)`` runs merged into the fewest."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
