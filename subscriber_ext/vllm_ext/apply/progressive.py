"""Prepare a version one layer at a time: each layer as soon as its tensors are final.

Why: building kernel-format shadows (``prepare.py``) after the whole version has
arrived adds their cost to every update. The live modules' state is snapshotted
once (``VersionPrep.__init__``, under the model lock), then each touched layer's
shadow is loaded and processed on its own (``build``), in any order, while later
layers are still on the wire; ``finish`` builds what is left, re-processes layers
tied to rebuilt tensors (a tied ``lm_head``, sent or not) and returns the
``PreparedVersion`` the commit copies in. Every build runs on the side stream of
``streams.py``. Nothing here touches a live module: a version that never
completes, or is cancelled, is simply dropped.

A ``PrepareBudget`` (``prepare_budget.py``) bounds the shadows: a layer that
does not fit is not built but listed in ``PreparedVersion.deferred`` and written
from the staged bytes at the commit.

``prepare_version`` is the all-at-once form (a version already complete).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

from subscriber_ext.vllm_ext.apply.loaders import load_into, private_quant_method
from subscriber_ext.vllm_ext.apply.names import Target
from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion, Shadow
from subscriber_ext.vllm_ext.apply.prepare_budget import Charge, PrepareBudget
from subscriber_ext.vllm_ext.apply.streams import PrepStream
from weightpub_wire.errors import ApplyError

__all__ = ["LayerPlan", "VersionPrep", "prepare_version"]

#: per touched module: (where each tensor goes, the tensor's key in the version's mapping)
LayerPlan = dict[str, list[tuple[Target, str]]]

logger = logging.getLogger("weightpub.prepare")


class VersionPrep:
    """Shadows of one version's touched layers, built layer by layer, then finished.

    Used by one thread at a time (the preparer's). ``early`` counts the layers built
    before ``finish`` (while the version was still arriving). ``budget``: each shadow
    is charged before it is built; the layers that do not fit are ``deferred``.
    """

    def __init__(self, model: torch.nn.Module, plan: LayerPlan, *, version: int,
                 publisher_id: str, model_lock: threading.Lock | threading.RLock,
                 stream: PrepStream | None = None,
                 budget: PrepareBudget | None = None) -> None:
        self.version = version
        self.charge = Charge(budget)
        self.deferred: set[str] = set()  # layers written from staging at the commit
        self.publisher_id = publisher_id
        self.stream = stream if stream is not None else PrepStream(torch.device("cpu"))
        self.applied: list[str] = []  # checkpoint names, for the commit's report
        self.ignored: list[str] = []
        self.early = 0
        self.work_s = 0.0  # time spent building (not waiting for bytes)
        start = time.perf_counter()
        self._sources: set[int] = set()
        #: sent tensors dropped for the tied tensor they alias: (alias key, owner key, names)
        self.aliases: list[tuple[str, str, str]] = []
        with model_lock, self.stream.building():
            plan = self._untie(model, plan)
            self.plan = plan
            self.pending = set(plan)
            self.shadows = {n: Shadow(n, model.get_submodule(n)) for n in plan}
            owner: dict[int, tuple[str, str]] = {}  # storage ptr -> (module, attr) replaced
            for n, sh in self.shadows.items():
                for attr, p in sh.live._parameters.items():
                    if p is not None and p.numel():
                        if p.data_ptr() in owner:
                            raise ApplyError(f"{n}.{attr}: shares storage with "
                                             f"{'.'.join(owner[p.data_ptr()])}; cannot prepare")
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

    def _untie(self, model: torch.nn.Module, plan: LayerPlan) -> LayerPlan:
        """Drop sent tensors whose live storage another sent tensor fills (a tied head).

        Why: a tied ``lm_head.weight`` is the embedding's storage; loading it twice into
        two shadows would make two tensors of one. The owner is the name the model lists
        first (the embedding, as vLLM's and transformers' loaders keep it); the alias's
        layer is then rebuilt as a tied layer on the owner's new tensor.
        """
        first: dict[int, str] = {}  # storage -> the model's first name for it
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.numel():
                first.setdefault(p.data_ptr(), name)
        sent: dict[int, list[tuple[str, Target, str]]] = {}
        for module_name, entries in plan.items():
            for target, key in entries:
                if target.expert is not None:
                    continue
                live = model.get_submodule(module_name)._parameters.get(target.attr)
                if live is not None and live.numel():
                    sent.setdefault(live.data_ptr(), []).append((module_name, target, key))
        drop: set[str] = set()
        for ptr, users in sent.items():
            owners = {m for m, _, _ in users}
            if len(owners) < 2:
                continue
            first_module = first[ptr].rpartition(".")[0]
            keep = first_module if first_module in owners else users[0][0]
            by_part = {(t.attr, t.shard_id): (k, t.checkpoint_name)
                       for m, t, k in users if m == keep}
            for m, t, k in users:
                if m != keep:
                    drop.add(k)
                    owner_key, owner_name = by_part.get((t.attr, t.shard_id), ("", "?"))
                    self.aliases.append((k, owner_key, f"{t.checkpoint_name} ({owner_name})"))
        if not drop:
            return plan
        out: LayerPlan = {}
        for module_name, entries in plan.items():
            kept = [(t, k) for t, k in entries if k not in drop]
            if kept and len(kept) < len(entries):
                raise ApplyError(f"{module_name}: partly tied layer; cannot prepare")
            if kept:
                out[module_name] = kept
        return out

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
        if not self.charge.take(_shadow_bytes(sh)):
            self.pending.discard(module_name)
            self.deferred.add(module_name)
            return
        with torch.no_grad(), self.stream.building():
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
        for alias, owner, names in self.aliases:
            a, o = tensors.get(alias), tensors.get(owner)
            if a is not None and o is not None and not torch.equal(a, o):
                logger.warning("weightpub: version %d: tied tensor %s differs from the one "
                               "whose storage it shares (in parentheses), which is used",
                               self.version, names)
        built_tied: list[Shadow] = []
        reprocess: list[str] = []
        with torch.no_grad(), self.stream.building():
            for n, (sh, links) in self.tied.items():
                if any(m in self.deferred for m, _ in links.values()):
                    continue  # its owner is reloaded at the commit, which re-processes it
                if not self.charge.take(_shadow_bytes(sh, tied=True)):
                    reprocess.append(n)  # processed on the live module after the copy
                    continue
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
                built_tied.append(sh)
        out = PreparedVersion(self.version, self.publisher_id, applied=list(self.applied),
                              ignored=list(self.ignored), stream=self.stream,
                              deferred=sorted(self.deferred), reprocess=reprocess,
                              charge=self.charge)
        built = [sh for n, sh in self.shadows.items() if n not in self.deferred]
        for sh in [*built, *built_tied]:
            swap = sh.to_swap()
            moved = swap.moved()
            if moved and self.stream.cuda:
                # a captured CUDA graph would keep reading the old tensor (then freed)
                raise ApplyError(f"{', '.join(moved)}: shape or dtype changed in processing; "
                                 "cannot keep the storage CUDA graphs read")
            if moved:
                logger.info("weightpub: %s swapped in as new tensors (shape or dtype changed)",
                            ", ".join(moved))
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
        out.ready = self.stream.done()
        self.work_s += time.perf_counter() - start
        out.seconds = self.work_s
        return out


def _shadow_bytes(sh: Shadow, *, tied: bool = False) -> int:
    """What a layer's shadow holds once built: its parameters in checkpoint format (vLLM's
    reload metadata; the kernel format is about as large) and its cloned buffers.
    A tied layer shares its owner's tensor: its kernel copy is as large as that."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    restore, _ = get_layerwise_info(sh.live).restore_metadata
    total = sum(t.numel() * t.element_size() for t in restore.values())
    if not total or tied:
        total = max(total, sum(p.numel() * p.element_size()
                               for p in sh.live._parameters.values() if p is not None))
    return total + sum(b.numel() * b.element_size()
                       for b in sh.module._buffers.values() if b is not None)


def prepare_version(
    model: torch.nn.Module,
    todo: list[tuple[Target, torch.Tensor]],
    *,
    version: int,
    publisher_id: str,
    model_lock: threading.Lock | threading.RLock,
    stream: PrepStream | None = None,
    budget: PrepareBudget | None = None,
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
                       model_lock=model_lock, stream=stream, budget=budget)
    return prep.finish(tensors)
