"""Prepare a version one layer at a time: each layer as soon as its tensors are final.

Why: building kernel-format shadows (``prepare.py``) after the whole version has
arrived adds their cost to every update. The live modules' state is snapshotted
once (``VersionPrep.__init__``, under the model lock), then each touched layer's
shadow is loaded and processed on its own (``build``), in any order, while later
layers are still on the wire; ``finish`` builds what is left, re-processes layers
tied to rebuilt tensors (a tied ``lm_head``) and returns the ``PreparedVersion``
the commit swaps in. Nothing here touches a live module: a version that never
completes, or is cancelled, is simply dropped.

``prepare_version`` is the all-at-once form (a version already complete).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from subscriber_ext.apply.loaders import load_into, private_quant_method
from subscriber_ext.apply.names import Target
from subscriber_ext.apply.prepare import PreparedVersion, Shadow
from weightpub_wire.errors import ApplyError

__all__ = ["LayerPlan", "VersionPrep", "prepare_version"]

#: per touched module: (where each tensor goes, the tensor's key in the version's mapping)
LayerPlan = dict[str, list[tuple[Target, str]]]


class VersionPrep:
    """Shadows of one version's touched layers, built layer by layer, then finished.

    Used by one thread at a time (the preparer's). ``early`` counts the layers built
    before ``finish`` (while the version was still arriving).
    """

    def __init__(self, model: torch.nn.Module, plan: LayerPlan, *, version: int,
                 publisher_id: str, model_lock: threading.Lock | threading.RLock) -> None:
        self.version = version
        self.publisher_id = publisher_id
        self.plan = plan
        self.pending = set(plan)
        self.applied: list[str] = []  # checkpoint names, for the commit's report
        self.ignored: list[str] = []
        self.early = 0
        self.work_s = 0.0  # time spent building (not waiting for bytes)
        start = time.perf_counter()
        self._sources: set[int] = set()
        with model_lock:
            self.shadows = {n: Shadow(n, model.get_submodule(n)) for n in plan}
            owner: dict[int, tuple[str, str]] = {}  # storage ptr -> (module, attr) replaced
            for n, sh in self.shadows.items():
                for attr, p in sh.live._parameters.items():
                    if p is not None and p.numel():
                        if p.data_ptr() in owner:
                            raise ApplyError(f"{n}.{attr}: shares storage with another sent "
                                             "tensor")
                        owner[p.data_ptr()] = (n, attr)
            self.tied: dict[str, tuple[Shadow, dict[str, tuple[str, str]]]] = {}
            for n, mod in model.named_modules():
                if n in self.shadows:
                    continue
                links = {
                    attr: owner[p.data_ptr()]
                    for attr, p in mod._parameters.items()
                    if p is not None and p.numel() and p.data_ptr() in owner
                }
                if links:
                    self.tied[n] = (Shadow(n, mod), links)
        self.work_s += time.perf_counter() - start

    def ready_layers(self, ready: set[str]) -> list[str]:
        """Layers not built yet whose every tensor (by key) is in ``ready``."""
        return [n for n in self.plan if n in self.pending
                and all(key in ready for _, key in self.plan[n])]

    def build(self, module_name: str, tensors: Mapping[str, torch.Tensor],
              *, early: bool = False) -> None:
        """Load and process one layer's shadow from ``tensors`` (its final bytes)."""
        from vllm.model_executor.model_loader.reload.meta import CopyCounter

        start = time.perf_counter()
        sh = self.shadows[module_name]
        with torch.no_grad():
            sh.fresh_params({})
            private_quant_method(sh.module)
            params = sh.module._parameters
            for target, key in self.plan[module_name]:
                tensor = tensors[key]
                self._sources.add(tensor.untyped_storage().data_ptr())
                param = params.get(target.attr)
                if param is None:
                    raise ApplyError(f"{target.param_name}: no such parameter on the layer")
                with CopyCounter() as counter:  # thread-local dispatch mode
                    here = load_into(param, target, tensor)
                if here and counter.copied_numel == 0:
                    raise ApplyError(f"{target.checkpoint_name}: the layer's loader wrote "
                                     "nothing")
            sh.process()
        self.pending.discard(module_name)
        self.early += early
        self.work_s += time.perf_counter() - start

    def finish(self, tensors: Mapping[str, torch.Tensor]) -> PreparedVersion:
        """Build the layers left, then the tied ones; the result swaps in at commit."""
        for name in [n for n in self.plan if n in self.pending]:
            self.build(name, tensors)
        start = time.perf_counter()
        with torch.no_grad():
            for n, (sh, links) in self.tied.items():
                # the tied layer keeps sharing the (new) tensor; only its own state is rebuilt
                shared = {a: self.shadows[m].module._parameters[src]
                          for a, (m, src) in links.items()}
                for attr in shared:
                    if shared[attr] is None:
                        raise ApplyError(f"{n}.{attr}: tied tensor was removed by processing")
                sh.fresh_params(shared)  # type: ignore[arg-type]
                untied = set(sh.module._parameters) - set(shared)
                if any(sh.module._parameters[a] is not None for a in untied):
                    raise ApplyError(f"{n}: partly tied layer; cannot prepare")
                sh.process()
        out = PreparedVersion(self.version, self.publisher_id, applied=list(self.applied),
                              ignored=list(self.ignored))
        for sh in [*self.shadows.values(), *(s for s, _ in self.tied.values())]:
            swap = sh.to_swap()
            for t in [*swap.params.values(), *swap.buffers.values()]:
                if t is not None and t.numel() and t.untyped_storage().data_ptr() in \
                        self._sources:
                    # the staged buffer is reused after release; the shadow must own its bytes
                    raise ApplyError(f"{sh.name}: a loader kept a view of the sent tensor")
            out.swaps.append(swap)
            out.nbytes += sum(
                p.numel() * p.element_size() for p in swap.params.values() if p is not None
            )
        out.early_layers = self.early
        self.work_s += time.perf_counter() - start
        out.seconds = self.work_s
        return out


def prepare_version(
    model: torch.nn.Module,
    todo: list[tuple[Target, torch.Tensor]],
    *,
    version: int,
    publisher_id: str,
    model_lock: threading.Lock | threading.RLock,
) -> PreparedVersion:
    """Build the shadows of every layer ``todo`` touches (and of layers tied to them).

    ``todo`` must already be checked (``WeightApplier.check``, whole layers).
    Only the live modules' attribute snapshot is taken under ``model_lock``;
    loading and kernel processing run unlocked, on private tensors.
    """
    tensors = {str(i): tensor for i, (_, tensor) in enumerate(todo)}
    plan: LayerPlan = {}
    for i, (target, _) in enumerate(todo):
        plan.setdefault(target.module_name, []).append((target, str(i)))
    prep = VersionPrep(model, plan, version=version, publisher_id=publisher_id,
                       model_lock=model_lock)
    return prep.finish(tensors)
