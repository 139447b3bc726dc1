"""Does a set of checkpoint tensors fit the live model? Checked before anything is written.

Why apart from ``applier.py`` (which writes): the checks (a known target, one
tensor per target, the model's dtype and shape per shard and expert, every part
of each layer that reload mode replaces whole) only read the model, and they are
what makes apply all or nothing: a bad tensor is named before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.loaders import in_place_safe
from subscriber_ext.vllm_ext.apply.names import NameResolver, Target
from subscriber_ext.vllm_ext.apply.shapes import (
    expected_dtype,
    expected_shape,
    loader_parts,
    original_tensor,
)
from weightpub_wire.errors import ApplyError

__all__ = ["CheckedTensor", "SpecChecker", "TensorSpec"]


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor claims to be, before its bytes are looked at."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str | None = None  # the published name, when the layout was converted

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, source: str | None = None) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape), source)

    @property
    def label(self) -> str:
        """How errors name the tensor: as published (and as converted, if it was)."""
        if self.source is None:
            return repr(self.name)
        return f"{self.source!r} (checkpoint tensor {self.name!r})"

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


#: a checked checkpoint tensor: what it is, where it goes (None: ignored), its data
CheckedTensor = tuple[TensorSpec, Target | None, torch.Tensor]


class SpecChecker:
    """Checks specs against ``model`` as ``resolver`` maps them; ``mode()`` is the
    applier's concrete mode (``in_place`` or ``reload``)."""

    def __init__(self, model: torch.nn.Module, resolver: NameResolver,
                 mode: Callable[[], str]) -> None:
        self.model = model
        self.resolver = resolver
        self.mode = mode

    def check(
        self, specs: list[TensorSpec], whole_layers: bool | None
    ) -> list[tuple[TensorSpec, Target | None]]:
        """Each spec with its target (None: ignored); ``ApplyError`` names the first bad one.
        ``whole_layers`` (None: in reload mode) also demands every part of each layer."""
        resolver = self.resolver
        out: list[tuple[TensorSpec, Target | None]] = []
        seen: dict[tuple[str, Any, Any], TensorSpec] = {}
        for spec in specs:
            try:
                target = resolver.resolve(spec.name)
            except ApplyError as exc:
                if spec.source is None:
                    raise
                raise ApplyError(f"{exc} (published as {spec.source!r})") from None
            out.append((spec, target))
            if target is None:
                continue
            key = (target.param_name, target.shard_id, target.expert)
            if key in seen and seen[key].name != spec.name:
                raise ApplyError(f"tensor {spec.label}: same target as {seen[key].label}")
            seen[key] = spec
            module = self.model.get_submodule(target.module_name)
            live = resolver.params[target.param_name]
            want_dtype = expected_dtype(module, target.attr, live)
            if spec.dtype != want_dtype:
                raise ApplyError(
                    f"tensor {spec.label}: dtype {spec.dtype} but the model expects {want_dtype}"
                )
            experts = resolver.experts.layers.get(target.module_name)
            if experts is not None and self.mode() == "in_place" and not in_place_safe(module):
                raise ApplyError(
                    f"tensor {spec.label}: {target.module_name!r} keeps its experts in a "
                    "kernel layout that in-place writes cannot reach; use apply_mode 'reload'"
                )
            want_shape = expected_shape(module, target.attr, target.shard_id, live, experts)
            if want_shape is not None and tuple(spec.shape) != tuple(want_shape):
                what = "" if target.expert is None else f" for one expert ({target.shard_id})"
                raise ApplyError(
                    f"tensor {spec.label}: shape {tuple(spec.shape)} but the model expects "
                    f"{tuple(want_shape)}{what}"
                )
        if whole_layers if whole_layers is not None else self.mode() == "reload":
            missing = self.missing_parts([t for _, t in out if t is not None])
            for module_name, parts in missing.items():
                more = f" and {len(parts) - 1} more" if len(parts) > 1 else ""
                raise ApplyError(
                    f"tensor for {parts[0]!r}{more} missing: reload mode replaces whole "
                    f"layers, send every tensor of {module_name!r}"
                )
        return out

    def missing_parts(self, targets: Iterable[Target]) -> dict[str, list[str]]:
        """Per touched layer, the parameter parts (``name[shard]``) not among ``targets``."""
        got: dict[str, set[tuple[str, Any, Any]]] = {}
        for t in targets:
            got.setdefault(t.module_name, set()).add(t.part)
        experts = self.resolver.experts.layers
        missing: dict[str, list[str]] = {}
        for module_name, have in got.items():
            module = self.model.get_submodule(module_name)
            for attr, _ in module.named_parameters(recurse=False):
                if original_tensor(module, attr) is None and attr != "bias":
                    continue
                for shard, expert in loader_parts(module, attr, experts.get(module_name)):
                    if (attr, shard, expert) not in have:
                        where = [] if shard is None else [str(shard)]
                        where += [] if expert is None else [f"expert {expert}"]
                        part = f"{module_name}.{attr}" + (f"[{', '.join(where)}]" if where else "")
                        missing.setdefault(module_name, []).append(part)
        return missing
