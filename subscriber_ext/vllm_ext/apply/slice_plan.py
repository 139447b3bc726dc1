"""One rank's slice plan: the byte ranges of each published tensor its parameters read.

Why: so each rank of a replica can fetch only its own bytes (issue 30) instead of
every rank (or its node) receiving whole tensors. The plan is recorded once per
model and layout by running this rank's own weight loaders on stand-ins
(``slice_record.RangeTensor``), through the same path a version takes
(``WeightApplier.checked_tensors``: checkpoint names and layouts, fused
q/k/v and gate/up shards, experts, tied embeddings) into meta copies of the
parameters (``Shadow.fresh_params(device=meta)``: vLLM's pre-repack reload
metadata), so nothing real is allocated or written. A tensor the loaders treat
in a way that is not a slice, or that fails to record, is planned whole: the
plan may ask for too much, never too little. ``check_plan`` proves a plan on real
bytes: the parameters loaded from the published tensors and from copies whose
bytes outside the plan are poisoned must be equal.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.loaders import load_into
from subscriber_ext.vllm_ext.apply.names import Target
from subscriber_ext.vllm_ext.apply.prepare import Shadow
from subscriber_ext.vllm_ext.apply.slice_record import RangeSink, RangeTensor, merge_runs

__all__ = ["SlicePlan", "check_plan", "record_plan"]

logger = logging.getLogger("weightpub.slices")

#: (published name, dtype, shape), as a manifest lists them
Entry = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class SlicePlan:
    """Per published tensor, the byte ranges ``[start, end)`` one rank needs (sorted, merged)."""

    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # each tensor's whole byte size
    whole: dict[str, str] = field(default_factory=dict)  # planned whole, and why

    @property
    def needed_bytes(self) -> int:
        return sum(end - start for runs in self.ranges.values() for start, end in runs)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def summary(self) -> dict[str, Any]:
        """JSON-friendly figures (an RPC reply)."""
        return {"needed_bytes": self.needed_bytes, "total_bytes": self.total_bytes,
                "tensors": len(self.sizes), "sliced": sum(
                    1 for n, r in self.ranges.items()
                    if sum(e - s for s, e in r) < self.sizes[n]),
                "whole": dict(self.whole)}


def record_plan(applier: Any, entries: Iterable[Entry]) -> SlicePlan:
    """Record which bytes of each entry this rank's loaders read (a ``WeightApplier``'s)."""
    entries = list(entries)
    plan = SlicePlan()
    sink = RangeSink()
    stand_ins = [(name, RangeTensor(name, shape, dtype, sink)) for name, dtype, shape in entries]
    for name, dtype, shape in entries:
        plan.sizes[name] = _numel(shape) * _itemsize(dtype)
    try:
        checked = applier.checked_tensors(stand_ins, whole_layers=False)
    except Exception as exc:  # a layout conversion that is not a view: plan every tensor whole
        logger.info("weightpub slice plan: conversion is not a slice (%s); whole tensors", exc)
        for name, _, _ in entries:
            plan.whole[name] = f"conversion: {exc}"
        checked = []
    shadows: dict[str, Shadow] = {}
    with torch.no_grad():
        for spec, target, tensor in checked:
            source = getattr(tensor, "_name", spec.source or spec.name)
            if target is None or not isinstance(tensor, RangeTensor):
                continue  # not on this rank (another PP stage, an ignored name)
            try:
                _record_one(applier.model, shadows, target, tensor)
            except Exception as exc:  # anything that is not a slice: planned whole
                plan.whole[source] = f"{type(exc).__name__}: {exc}"
    itemsize = {name: _itemsize(dtype) for name, dtype, _ in entries}
    for name, runs in sink.runs.items():
        size = itemsize[name]
        plan.ranges[name] = merge_runs((s * size, e * size) for s, e in runs)
    for name in plan.whole:
        plan.ranges[name] = [(0, plan.sizes[name])]
    return plan


def _record_one(model: torch.nn.Module, shadows: dict[str, Shadow], target: Target,
                tensor: RangeTensor) -> None:
    shadow = shadows.get(target.module_name)
    if shadow is None:
        shadow = Shadow(target.module_name, model.get_submodule(target.module_name))
        shadow.fresh_params({}, device=torch.device("meta"))
        shadows[target.module_name] = shadow
    param = shadow.module._parameters.get(target.attr)
    if param is None:
        raise LookupError(f"{target.param_name}: no such parameter on the layer")
    load_into(param, target, tensor)


def check_plan(applier: Any, plan: SlicePlan, tensors: Mapping[str, torch.Tensor],
               ) -> list[str]:
    """The parameters whose loaded values differ when bytes outside ``plan`` are poisoned.

    Loads ``tensors`` (the published ones) and copies of them with every byte the
    plan leaves out overwritten, each into fresh real shadows of the touched layers
    through the same loaders, and compares the results bit for bit. An empty list
    proves the plan holds for this rank on these weights.
    """
    poisoned = {name: _poison(t, plan.ranges.get(name, [])) for name, t in tensors.items()}
    clean = _load_all(applier, tensors)
    dirty = _load_all(applier, poisoned)
    return sorted(key for key in clean if not _same(clean[key], dirty.get(key)))


def _poison(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    out = tensor.detach().clone().contiguous()
    raw = out.view(-1).view(torch.uint8)
    keep = torch.zeros(raw.numel(), dtype=torch.bool)
    for start, end in ranges:
        keep[start:end] = True
    raw[~keep] = 0x7F  # NaN-ish in every float format, far from any real value
    return out


def _load_all(applier: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    shadows: dict[str, Shadow] = {}
    with torch.no_grad():
        for _spec, target, tensor in applier.checked_tensors(tensors.items(),
                                                             whole_layers=False):
            if target is None:
                continue
            shadow = shadows.get(target.module_name)
            if shadow is None:
                shadow = Shadow(target.module_name,
                                applier.model.get_submodule(target.module_name))
                shadow.fresh_params({})
                shadows[target.module_name] = shadow
            param = shadow.module._parameters[target.attr]
            assert param is not None
            load_into(param, target, tensor)
    for module_name, shadow in shadows.items():
        for attr, param in shadow.module._parameters.items():
            if param is not None:
                loaded[f"{module_name}.{attr}"] = param.detach().clone()
    return loaded


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and bool(
        torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
