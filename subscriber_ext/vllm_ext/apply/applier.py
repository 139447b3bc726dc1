"""Write a set of checkpoint-named tensors into a live vLLM model, all or nothing.

Why: the weights must change only after every tensor has been checked (name,
shape, dtype), and the write must go through vLLM's own loaders so TP slicing,
fused shards, GQA head replication, vocab padding and tied embeddings stay
right. Two ways exist and are chosen per model/backend:

* ``in_place``: call each parameter's own ``weight_loader`` on the live
  parameter. Cheapest (one copy of the rank's shard), valid when the kernel
  layout equals the checkpoint layout (unquantized GPU models).
* ``reload``: vLLM's layerwise reload (``model_runner.reload_weights(...,
  is_checkpoint_format=True)``), which re-runs ``process_weights_after_loading``.
  Needed when parameters were repacked (CPU backend: linear weights show shape
  ``[0]``) or quantized. A layer can only be reloaded whole, so ``check`` then
  also demands every tensor of each touched layer (for a fused-expert layer:
  every projection of every expert).

Tensors are first brought to checkpoint names and layouts (``layout.py``:
transformers' in-memory MoE layout -> per-expert checkpoint tensors), so a
trainer may publish ``model.state_dict()`` of a transformers model as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from subscriber_ext.vllm_ext.apply.experts import ExpertIndex
from subscriber_ext.vllm_ext.apply.layout import CheckpointLayout
from subscriber_ext.vllm_ext.apply.loaders import first_load_processing, in_place_safe, load_into
from subscriber_ext.vllm_ext.apply.names import NameResolver, Target
from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.apply.prepare_budget import PrepareBudget
from subscriber_ext.vllm_ext.apply.progressive import LayerPlan, VersionPrep, prepare_version
from subscriber_ext.vllm_ext.apply.spec_checks import CheckedTensor, SpecChecker, TensorSpec
from subscriber_ext.vllm_ext.apply.streams import PrepStream
from weightpub_wire.dtypes import dtype_from_name
from weightpub_wire.errors import ApplyError, ConfigError

__all__ = ["APPLY_MODES", "ApplyReport", "CheckedTensor", "TensorSpec", "WeightApplier"]

logger = logging.getLogger("weightpub.apply")

ApplyMode = Literal["auto", "in_place", "reload"]
APPLY_MODES: tuple[str, ...] = get_args(ApplyMode)


@dataclass
class ApplyReport:
    """Outcome of one ``apply`` call (also kept as ``WeightApplier.last_report``)."""

    mode: str
    seconds: float
    applied: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


class WeightApplier:
    """Checks and applies checkpoint-named tensors to one worker's model."""

    def __init__(self, model_runner: Any, vllm_config: Any = None, apply_mode: str = "auto"):
        if apply_mode not in APPLY_MODES:
            raise ConfigError(f"apply_mode: expected one of {APPLY_MODES}, got {apply_mode!r}")
        self.model_runner = model_runner
        self.vllm_config = vllm_config if vllm_config is not None else model_runner.vllm_config
        self.apply_mode = apply_mode
        self._resolver: NameResolver | None = None
        self._experts: ExpertIndex | None = None
        self._layout: CheckpointLayout | None = None
        self._mode: str | None = None
        self.last_report: ApplyReport | None = None
        self._stream: PrepStream | None = None
        self._mla: list[torch.nn.Module] | None = None  # MLA attention layers, found once
        #: held while the live modules change (apply, swap) or are snapshot (prepare)
        self.lock = threading.RLock()
        #: what prepared shadows may hold on this rank (None: unbounded)
        self.prepare_budget = PrepareBudget(None)

    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    @property
    def stream(self) -> PrepStream:
        """The preparer's side stream on this rank's device (``streams.py``)."""
        if self._stream is None:
            self._stream = PrepStream.for_model(self.model)
        return self._stream

    @property
    def resolver(self) -> NameResolver:
        if self._resolver is None:
            self._resolver = NameResolver(self.model, self._experts)
            self._experts = self._resolver.experts
        return self._resolver

    @property
    def layout(self) -> CheckpointLayout:
        """Converts published tensors to checkpoint tensors (kept: holds a skeleton)."""
        if self._layout is None:
            hf_config = getattr(getattr(self.vllm_config, "model_config", None), "hf_config", None)
            self._layout = CheckpointLayout(hf_config)
        return self._layout

    # ------------------------------------------------------------------ mode
    def mode(self) -> str:
        """The concrete mode (``in_place`` or ``reload``); ``auto`` is decided once."""
        if self._mode is None:
            self._mode = self.apply_mode if self.apply_mode != "auto" else self._detect_mode()
            logger.info("weightpub apply mode: %s (option %s)", self._mode, self.apply_mode)
        return self._mode

    def _detect_mode(self) -> str:
        model_config = getattr(self.vllm_config, "model_config", None)
        if getattr(model_config, "quantization", None):
            return "reload"
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                return "reload"  # CPU linear weights are repacked after loading
        except ImportError:  # pragma: no cover
            pass
        if any(p.numel() == 0 for p in self.resolver.params.values()):
            return "reload"  # some parameter lives in a kernel-only layout
        if any(not in_place_safe(layer.module) for layer in self.resolver.experts):
            return "reload"  # MoE experts shuffled/packed for their kernel
        return "in_place"

    # ----------------------------------------------------------------- check
    def check(
        self, specs: Iterable[TensorSpec], *, whole_layers: bool | None = None
    ) -> list[tuple[TensorSpec, Target | None]]:
        """Validate every spec; raise ApplyError naming the first bad tensor. Touches nothing.

        Returns the checkpoint tensors the specs convert to (``spec.source`` names the
        published one). ``whole_layers`` (default: true in reload mode) also demands
        every tensor of each touched layer.
        """
        converted = self.layout.to_checkpoint(((s.name, s.meta()) for s in specs), self.resolver)
        return self._check(
            [TensorSpec.of(c.name, c.tensor, c.source) for c in converted], whole_layers
        )

    def checked_tensors(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        whole_layers: bool | None = None,
    ) -> list[CheckedTensor]:
        """``check`` on real tensors: the checkpoint tensors (views) with their targets."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        converted = self.layout.to_checkpoint(items, self.resolver)
        specs = [TensorSpec.of(c.name, c.tensor, c.source) for c in converted]
        checked = self._check(specs, whole_layers)
        return [(spec, target, c.tensor) for (spec, target), c in zip(checked, converted,
                                                                         strict=True)]

    def _check(
        self, specs: list[TensorSpec], whole_layers: bool | None
    ) -> list[tuple[TensorSpec, Target | None]]:
        checker = SpecChecker(self.model, self.resolver, self.mode)
        return checker.check(specs, whole_layers)

    def missing_parts(self, targets: Iterable[Target]) -> dict[str, list[str]]:
        """Per touched layer, the parameter parts (``name[shard]``) not among ``targets``."""
        return SpecChecker(self.model, self.resolver, self.mode).missing_parts(targets)

    # ----------------------------------------------------------------- apply
    def apply(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> ApplyReport:
        """Check everything, then write it. On a check failure nothing has changed."""
        checked = self.checked_tensors(named_tensors)
        mode = self.mode()
        report = ApplyReport(mode=mode, seconds=0.0)
        todo: list[tuple[Target, torch.Tensor]] = []
        for spec, target, tensor in checked:
            if target is None:
                report.ignored.append(spec.name)
            else:
                todo.append((target, tensor))
                report.applied.append(spec.name)
        start = time.perf_counter()
        try:
            with torch.no_grad(), self.lock:
                if mode == "in_place":
                    self._apply_in_place(todo)
                else:
                    self._apply_reload(todo)
        except ApplyError:
            raise
        except Exception as exc:
            raise ApplyError(f"applying {len(todo)} tensors ({mode}) failed: {exc}") from exc
        report.seconds = time.perf_counter() - start
        self.last_report = report
        logger.info("weightpub applied %d tensors (%s) in %.3f s", len(todo), mode, report.seconds)
        return report

    def prepare(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        publisher_id: str,
    ) -> PreparedVersion:
        """Check, then build kernel-format shadows of the touched layers (any thread).

        Why: moves the loader + ``process_weights_after_loading`` work of reload mode
        off the step path; ``swap`` later installs the result.
        """
        checked = self.checked_tensors(named_tensors, whole_layers=True)
        todo: list[tuple[Target, torch.Tensor]] = []
        ignored: list[str] = []
        for spec, target, tensor in checked:
            if target is None:
                ignored.append(spec.name)
            else:
                todo.append((target, tensor))
        self._refuse_derived({t.module_name for t, _ in todo})
        prepared = prepare_version(
            self.model, todo, version=version, publisher_id=publisher_id, model_lock=self.lock,
            stream=self.stream, budget=self.prepare_budget,
        )
        prepared.applied = [t.checkpoint_name for t, _ in todo]
        prepared.ignored = ignored
        return prepared

    def start_progressive(
        self, entries: Iterable[tuple[str, str, tuple[int, ...]]], *, version: int,
        publisher_id: str,
    ) -> VersionPrep | None:
        """Plan a version that is still arriving, from its manifest's (name, dtype, shape).

        Returns None when it cannot be prepared layer by layer: a check fails (the
        commit reports it), or the published layout is converted (fused MoE experts:
        prepared once complete). Otherwise each layer is built as its tensors arrive.
        """
        specs = [TensorSpec(name, dtype_from_name(dtype), tuple(shape))
                 for name, dtype, shape in entries]
        names = {spec.name for spec in specs}
        try:
            checked = self.check(specs, whole_layers=True)
        except ApplyError as exc:
            logger.info("weightpub: version %d not prepared while arriving: %s", version, exc)
            return None
        plan: LayerPlan = {}
        applied, ignored = [], []
        for spec, target in checked:
            if spec.source is not None or spec.name not in names:
                return None  # converted layout: the tensors to load exist only once complete
            if target is None:
                ignored.append(spec.name)
                continue
            plan.setdefault(target.module_name, []).append((target, spec.name))
            applied.append(target.checkpoint_name)
        try:
            self._refuse_derived(set(plan))
        except ApplyError as exc:
            logger.info("weightpub: version %d not prepared while arriving: %s", version, exc)
            return None
        prep = VersionPrep(self.model, plan, version=version, publisher_id=publisher_id,
                           model_lock=self.lock, stream=self.stream,
                           budget=self.prepare_budget)
        prep.applied, prep.ignored = applied, ignored
        return prep

    def swap(self, prepared: PreparedVersion,
             tensors: Mapping[str, torch.Tensor] | None = None) -> ApplyReport:
        """Install a prepared version: a device-local copy into the live storage (every
        parameter and buffer keeps its address), plus attribute swaps.

        Layers the prepare budget left out (``prepared.deferred``) are then written from
        the staged ``tensors`` as ``apply`` writes them (in place or vLLM's reload: the
        live parameters' own storage), checked before anything changes.
        """
        start = time.perf_counter()
        todo: list[tuple[Target, torch.Tensor]] = []
        if prepared.deferred:
            if tensors is None:
                raise ApplyError(f"version {prepared.version}: {len(prepared.deferred)} "
                                 "layers were not prepared and no staged tensors were given")
            deferred = set(prepared.deferred)
            todo = [(target, tensor) for _, target, tensor in
                    self.checked_tensors(tensors, whole_layers=self.mode() == "reload")
                    if target is not None and target.module_name in deferred]
        with torch.no_grad(), self.lock:
            prepared.swap()
            self._resolver = None  # a tensor whose shape changed is a new object
            self._refresh_derived({s.name for s in prepared.swaps})
            self._reprocess(prepared.reprocess)
            if todo:
                if self.mode() == "in_place":
                    self._apply_in_place(todo)
                else:
                    self._apply_reload(todo)
        report = ApplyReport(mode="prepared", seconds=time.perf_counter() - start)
        report.applied, report.ignored = prepared.applied, prepared.ignored
        self.last_report = report
        logger.info(
            "weightpub swapped in %d prepared layers (%d written from staging) in %.6f s",
            len(prepared.swaps), len(prepared.deferred), report.seconds
        )
        return report

    def _reprocess(self, names: Iterable[str]) -> None:
        """Re-run kernel processing of live layers (tied to a tensor just copied in)."""
        model = self.model
        for name in names:
            module = model.get_submodule(name)
            qm = getattr(module, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(module)

    def _apply_in_place(self, todo: list[tuple[Target, torch.Tensor]]) -> None:
        params = self.resolver.params
        for target, tensor in todo:
            load_into(params[target.param_name], target, tensor)
        touched = {t.module_name for t, _ in todo}
        self._reprocess_tied(touched)
        self._refresh_derived(touched)

    def _mla_layers(self, touched: set[str]) -> list[torch.nn.Module]:
        """MLA attention layers whose ``kv_b_proj`` is among the touched modules."""
        if self._mla is None:
            try:
                from vllm.model_executor.layers.attention import MLAAttention
            except ImportError:  # pragma: no cover
                MLAAttention = ()
            self._mla = [m for m in self.model.modules() if isinstance(m, MLAAttention)]
        if not self._mla:
            return []
        model = self.model
        fed = {id(model.get_submodule(n)) for n in touched}
        return [m for m in self._mla if id(getattr(m, "kv_b_proj", None)) in fed]

    def _refuse_derived(self, touched: set[str]) -> None:
        """Raise if preparing ``touched`` cannot be finished by ``_refresh_derived``.

        Why: on the CPU's AMX MLA path the attention layer packs ``kv_b_proj`` itself and
        drops its weight; that layer is left to vLLM's reload (which re-processes it).
        """
        for layer in self._mla_layers(touched):
            if getattr(layer, "is_amx_bmm_enabled", False):
                raise ApplyError(f"{getattr(layer, 'layer_name', 'MLA layer')}: AMX-packed "
                                 "kv_b_proj; committed by a reload")

    def _refresh_derived(self, touched: set[str]) -> None:
        """Recompute what attention layers derive from weights written outside a reload.

        Why: an MLA layer keeps ``W_UK_T`` / ``W_UV`` split out of ``kv_b_proj`` at load
        time; vLLM's layerwise reload re-runs the layer's ``process_weights_after_loading``
        after the other layers, which rewrites them in place (``replace_parameter(...,
        prefer_copy=True)``, vLLM 0.32). An in-place or prepared commit does the same.
        """
        layers = self._mla_layers(touched)
        if not layers:
            return
        dtype = self.vllm_config.model_config.dtype
        for layer in layers:
            process: Any = layer.process_weights_after_loading
            process(dtype)

    def _apply_reload(self, todo: list[tuple[Target, torch.Tensor]]) -> None:
        # model.load_weights (inside reload_weights) does its own stacking; hand it the
        # normalized checkpoint names. Silence the per-untouched-layer warning.
        weights = [(t.checkpoint_name, tensor) for t, tensor in todo]
        layerwise_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        inplace_log = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
        old = layerwise_log.level, inplace_log.level
        layerwise_log.setLevel(logging.ERROR)
        inplace_log.setLevel(logging.ERROR)
        model = self.model
        touched = [model.get_submodule(n) for n in {t.module_name for t, _ in todo}]
        try:
            with first_load_processing(touched):
                self.model_runner.reload_weights(
                    weights_iterator=weights, is_checkpoint_format=True
                )
        finally:
            layerwise_log.setLevel(old[0])
            inplace_log.setLevel(old[1])
        self._resolver = None  # parameters may be new objects after reload
        self._reprocess_tied({t.module_name for t, _ in todo})

    def _reprocess_tied(self, touched: set[str]) -> None:
        """Re-run kernel processing of layers that share a reloaded tensor (tied lm_head).

        Why: layerwise reload processes each layer once; a tied ``lm_head`` is not
        loaded itself, so its CPU packed copy of the embedding would stay stale.
        """
        model = self.model
        ptrs = set()
        for name in touched:
            for p in model.get_submodule(name).parameters(recurse=False):
                if p.numel():
                    ptrs.add(p.data_ptr())
        for name, module in model.named_modules():
            if name in touched:
                continue
            if any(p.numel() and p.data_ptr() in ptrs for p in module.parameters(recurse=False)):
                qm = getattr(module, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(module)
