"""Build a version's kernel-format weights off the step path; copy them in at commit.

Why: on the CPU backend (and for quantized models) a commit must re-run each
layer's ``process_weights_after_loading`` (oneDNN / sgl prepacking), which
vLLM's layerwise reload does inside the commit, blocking the engine's step
loop. Here a background thread builds, per touched layer, a *shadow*: a
shallow copy of the live module whose parameters are fresh tensors created
from vLLM's own reload metadata (``LAYERWISE_INFO[layer].restore_metadata``),
filled through the layer's own ``weight_loader`` (TP slicing, fused shards,
GQA replication, vocab padding) and processed by the layer's own
``quant_method``. The commit then copies the shadow's parameters and buffers
into the live tensors' storage (a device-local copy; the live objects, and so
the addresses captured CUDA graphs read, stay) and swaps in what cannot be
copied: changed non-tensor attributes (CPU GEMM handles ``cpu_linear``, a MoE
layer's kernel) and any tensor whose shape or dtype processing changed (see
``ModuleSwap``). The shadow is never reachable from the model before the
commit. Cost: one extra copy of the touched weights per rank while a version is
prepared, within the rank's ``PrepareBudget`` (``prepare_budget.py``: past it a
layer is written from staging at the commit instead); at the commit one
device-local copy of them (``streams.py`` says on which stream).

Fused-expert (MoE) layers are prepared too: each expert tensor goes through the
layer's loader with its expert id, and the shadow gets a private copy of the
layer's ``quant_method`` that processes like a first load (a new experts
kernel, weights packed for it; see ``loaders.py``), swapped in with the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.streams import PrepStream
from weightpub_wire.errors import ApplyError

__all__ = ["ModuleSwap", "PreparedVersion", "Shadow", "copies_into"]

logger = logging.getLogger("weightpub.prepare")

_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _rebind(tensor: torch.Tensor, old: Iterable[object], new: object) -> None:
    """Point methods bound to ``old`` objects (a layer, vLLM's sentinel) at ``new``."""
    olds = tuple(old)
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and any(value.__self__ is o for o in olds):
            tensor.__dict__[key] = value.__func__.__get__(new)


def _unwrap_loader(tensor: torch.Tensor) -> None:
    """Drop vLLM's layerwise-reload wrappers from ``tensor.weight_loader``.

    Why: a reload registers the metadata tensors themselves on the layer and wraps
    their loaders (``online_process_loader``); the wrappers stay on the metadata
    afterwards and would buffer our writes into the live layer's reload state
    instead of loading the shadow.
    """
    for key in ("weight_loader", "_weight_loader"):  # BasevLLMParameter keeps the latter
        loader = tensor.__dict__.get(key)
        if loader is None:
            continue
        while getattr(loader, "__name__", "") == "online_process_loader":
            loader = loader.__wrapped__
        tensor.__dict__[key] = loader


def _fresh_like(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A zeroed real tensor with ``meta``'s class, shape, strides and attributes."""
    size, stride = tuple(meta.size()), tuple(meta.stride())
    out = torch.empty_strided(size, stride, dtype=meta.dtype, device=device).zero_()
    out.__class__ = meta.__class__
    out.__dict__ = meta.__dict__.copy()
    out.requires_grad_(False)
    return out


def _clone_param(live: torch.Tensor) -> torch.Tensor:
    out = live.data.clone()
    out.__class__ = live.__class__
    out.__dict__ = live.__dict__.copy()
    out.requires_grad_(False)
    return out


def copies_into(live: object, new: object) -> bool:
    """True if ``new``'s values can be copied into ``live``'s storage (same layout).

    Why: captured CUDA graphs keep the addresses of the tensors they read; a commit
    that keeps them (as vLLM's layerwise reload does) stays valid for the graphs.
    """
    return (
        isinstance(live, torch.Tensor) and isinstance(new, torch.Tensor) and live is not new
        and live.shape == new.shape and live.dtype == new.dtype
        and live.device == new.device and live.stride() == new.stride()
    )


@dataclass
class ModuleSwap:
    """Everything the commit moves onto one live module.

    Parameters, buffers and tensor attributes whose live tensor has the same shape,
    dtype, strides and device are *copied into* the live storage (the live objects
    stay); only the rest (a tensor whose shape or dtype changed in processing, a new
    or removed one, non-tensor state such as CPU GEMM handles or a MoE layer's
    private ``quant_method``) is swapped in as an object.
    """

    name: str
    module: torch.nn.Module
    params: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor | None]
    non_persistent: set[str]
    attrs: dict[str, Any]
    removed: list[str]
    #: submodules replaced on the shadow (a MoE layer's private ``quant_method``)
    modules: dict[str, torch.nn.Module | None] = field(default_factory=dict)
    #: the live state replaced by ``apply`` and the tensors it copied from; kept so
    #: freeing them happens off the step path
    retired: list[Any] = field(default_factory=list)

    def moved(self) -> list[str]:
        """Live tensors that cannot keep their storage (shape/dtype changed, or removed)."""
        live = self.module
        out = []
        for container, new in ((live._parameters, self.params), (live._buffers, self.buffers)):
            for key, cur in container.items():
                t = new.get(key)
                if cur is not None and cur is not t and not copies_into(cur, t):
                    out.append(f"{self.name}.{key}")
        return out

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(live tensor, new values) pairs ``apply`` copies."""
        live = self.module
        out = []
        for container, new in ((live._parameters, self.params), (live._buffers, self.buffers)):
            for key, t in new.items():
                cur = container.get(key)
                if copies_into(cur, t):
                    out.append((cur, t))
        for key, value in self.attrs.items():
            cur = live.__dict__.get(key)
            if copies_into(cur, value):
                out.append((cur, value))
        return out  # type: ignore[return-value]

    def apply(self, copied: set[tuple[int, int]] | None = None) -> None:
        """Copy into (or swap onto) the live module. ``copied``: (dst, src) pointers done
        (a tied tensor reached through two modules is copied once)."""
        live = self.module
        copied = set() if copied is None else copied
        sources: list[torch.Tensor] = []
        with torch.no_grad():
            for dst, src in self.copies():
                pair = (dst.data_ptr(), src.data_ptr())
                if pair not in copied:
                    dst.copy_(src)
                    copied.add(pair)
                sources.append(src)

        def keep(container: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
            return {k: container[k] if copies_into(container.get(k), t) else t
                    for k, t in new.items()}

        params = keep(live._parameters, self.params)
        buffers = keep(live._buffers, self.buffers)
        attrs = {k: v for k, v in self.attrs.items() if not copies_into(live.__dict__.get(k), v)}
        self.retired = [
            sources,
            [t for k, t in live._parameters.items() if params.get(k) is not t],
            [t for k, t in live._buffers.items() if buffers.get(k) is not t],
            [live.__dict__.get(k) for k in [*attrs, *self.removed]],
            [live._modules.get(k) for k in self.modules],
        ]
        live._parameters.clear()
        live._parameters.update(params)
        live._buffers.clear()
        live._buffers.update(buffers)
        live._non_persistent_buffers_set.clear()
        live._non_persistent_buffers_set.update(self.non_persistent)
        live._modules.update(self.modules)
        live.__dict__.update(attrs)
        for key in self.removed:
            live.__dict__.pop(key, None)


@dataclass
class PreparedVersion:
    """A version ready to commit; holds its own copy of the touched weights."""

    version: int
    publisher_id: str
    swaps: list[ModuleSwap] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    applied: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    #: layers built while the version was still arriving (``progressive.py``)
    early_layers: int = 0
    #: the preparation's stream discipline and its end event (``streams.py``)
    stream: PrepStream | None = None
    ready: Any = None
    #: layers not prepared (past the prepare budget): written from the staged bytes at
    #: the commit (``WeightApplier.swap``)
    deferred: list[str] = field(default_factory=list)
    #: layers tied to a prepared one whose own kernel state did not fit: processed on
    #: the live module after the copy
    reprocess: list[str] = field(default_factory=list)
    #: the bytes these shadows hold in the prepare budget (given back when this goes)
    charge: Any = None

    def swap(self) -> None:
        """Step thread: copy every prepared tensor into the live storage (swap the rest)."""
        if self.stream is not None:
            self.stream.before_copy(self.ready)
        copied: set[tuple[int, int]] = set()
        for s in self.swaps:
            s.apply(copied)
        if self.stream is not None:
            self.stream.read_by_step(t for s in self.swaps for t in s.retired[0])
        self.nbytes = 0


class Shadow:
    """A shallow copy of one live module with its own parameter containers."""

    def __init__(self, name: str, live: torch.nn.Module) -> None:
        self.name = name
        self.live = live
        self.snapshot = dict(live.__dict__)
        mod = object.__new__(type(live))
        mod.__dict__.update(self.snapshot)
        mod.__dict__["_parameters"] = dict(live._parameters)
        mod.__dict__["_buffers"] = {
            k: (None if b is None else b.clone()) for k, b in live._buffers.items()
        }
        mod.__dict__["_modules"] = dict(live._modules)
        mod.__dict__["_non_persistent_buffers_set"] = set(live._non_persistent_buffers_set)
        self.module = mod

    def fresh_params(self, shared: dict[str, torch.Tensor], *,
                     device: torch.device | None = None) -> None:
        """Replace every parameter by a new tensor; ``shared`` ones by the given objects.

        ``device`` (default: where vLLM's reload would restore them): ``meta`` gives
        parameters without storage, for recording what the loaders do (``slice_plan``).
        """
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

        info = get_layerwise_info(self.live)
        restore, _ = info.restore_metadata
        params: dict[str, Any] = self.module._parameters
        for attr, live_param in list(params.items()):
            if attr in shared:
                params[attr] = shared[attr]
                continue
            meta = restore.get(attr)
            if meta is not None:
                fresh = _fresh_like(meta, device or info.restore_device)
            elif live_param is not None and live_param.numel() > 0:
                fresh = _clone_param(live_param) if device is None else \
                    _fresh_like(live_param, device)
            elif live_param is None:
                continue
            else:
                raise ApplyError(f"{self.name}.{attr}: kernel-only parameter without metadata")
            _unwrap_loader(fresh)
            _rebind(fresh, (layer_ref_sentinel, self.live), self.module)
            params[attr] = fresh
        for attr in restore.keys() - params.keys():
            raise ApplyError(f"{self.name}.{attr}: parameter in metadata but not on the layer")

    def process(self) -> None:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        mod = self.module
        if is_deferred_attention_layer(mod):
            raise ApplyError(f"{self.name}: attention layers are not prepared")
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase):
            mod.__dict__.pop("_already_called_process_weights_after_loading", None)
            qm.process_weights_after_loading(mod)
            update = getattr(mod, "update_param_tp_status", None)
            if callable(update):
                update()

    def to_swap(self) -> ModuleSwap:
        """What changed versus the live module, with loaders re-bound to the live one."""
        mod, live = self.module, self.live
        d = mod.__dict__
        for t in [*mod._parameters.values(), *mod._buffers.values()]:
            if t is not None:
                _rebind(t, (mod,), live)
        attrs: dict[str, Any] = {}
        for key, value in d.items():
            if key in _CONTAINERS:
                continue
            if isinstance(value, MethodType) and value.__self__ is mod:
                value = value.__func__.__get__(live)
            if key not in self.snapshot or self.snapshot[key] is not value:
                attrs[key] = value
        removed = [k for k in self.snapshot if k not in d and k not in _CONTAINERS]
        modules = {k: m for k, m in mod._modules.items() if live._modules.get(k) is not m}
        return ModuleSwap(
            self.name, live, dict(mod._parameters), dict(mod._buffers),
            set(mod._non_persistent_buffers_set), attrs, removed, modules,
        )
