"""Serve published LoRA adapters by name in a LoRA-enabled engine, from memory.

Why: requests name an adapter (``LoRARequest(name, id, path)``); vLLM's worker LoRA
manager loads an adapter from ``path`` the first time an id is seen, and again after
its LRU cache evicted it. For a published adapter there is no path: this class wraps
that manager's ``_load_adapter`` (an instance attribute, vLLM's class is untouched) so
a request whose *name* is a published adapter gets a ``LoRAModel`` built from the
held tensors (``LoRAModel.from_lora_tensors``) under the request's id, whatever its
path says; other names load as vLLM does. The cache can thus never fall back to a
placeholder path (or to an older version) for a published name.

Pitfall: vLLM multiplies ``lora_B`` by the scaling in place when it adds a model
(``LoRALayerWeights.optimize``), so every build hands it fresh copies of the held tensors;
a second load from the same tensors would otherwise scale them twice.

A new version of an adapter is applied at the commit (between two steps, every rank):
the held tensors are replaced, and every id of that name the manager holds is reloaded
in place (vLLM's ``load_inplace``: a real reload; the same id without it would keep the
old weights). Requests running with it continue on the new weights from the next step.
The base model is untouched. Several adapters are held at once, one per name.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from subscriber_ext.vllm_ext.lora.adapter_versions import AdapterVersion
from subscriber_ext.vllm_ext.lora.requests import PLACEHOLDER_SCHEME
from weightpub_wire.errors import ApplyError

__all__ = ["AdapterServer", "lora_manager_of"]

logger = logging.getLogger("weightpub.lora")


def lora_manager_of(model_runner: Any) -> Any | None:
    """The worker's LoRA manager (``LRUCacheWorkerLoRAManager``), None without LoRA."""
    manager = getattr(model_runner, "lora_manager", None)
    if manager is None or not hasattr(manager, "_adapter_manager"):
        return None
    return manager


class AdapterServer:
    """Holds the published adapters of one rank and keeps its LoRA manager on them."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._lock = threading.Lock()
        self._held: dict[str, AdapterVersion] = {}
        self._ids: dict[int, str] = {}  # ids the manager loaded for a published name
        self._vllm_load = manager._load_adapter
        manager._load_adapter = self._load_adapter
        self.reloads = 0

    # ------------------------------------------------------------ vLLM's entry
    def _load_adapter(self, request: Any) -> Any:
        """vLLM's loader, for a published name: the held tensors, never the path."""
        with self._lock:
            held = self._held.get(request.lora_name)
            # every load, published or not: a name published later reloads this id too
            self._ids[request.lora_int_id] = request.lora_name
            if len(self._ids) > 4096:
                loaded = set(self._manager.list_adapters())
                self._ids = {i: n for i, n in self._ids.items() if i in loaded}
        if held is None:
            if str(request.lora_path).startswith(PLACEHOLDER_SCHEME):
                raise ApplyError(f"LoRA adapter {request.lora_name!r}: not published to "
                                 "this replica yet (no version of it has been applied)")
            return self._vllm_load(request)
        return self.build(held, request.lora_int_id)

    def build(self, held: AdapterVersion, lora_id: int) -> Any:
        """A ``LoRAModel`` from ``held``'s tensors, checked as vLLM checks a directory."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mgr = self._manager
        adapters = mgr._adapter_manager
        info = held.info
        helper = PEFTHelper.from_dict({
            "r": info.rank, "lora_alpha": info.alpha,
            "target_modules": list(info.target_modules), "use_rslora": info.use_rslora,
            "vllm_max_position_embeddings": mgr.max_position_embeddings})
        try:
            helper.validate_legal(mgr.lora_config)
        except ValueError as exc:
            raise ApplyError(f"LoRA adapter {info.name!r}: {exc}") from None
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        expected = set()
        for module in adapters.supported_lora_modules:
            expected.update(adapters.packed_modules_mapping.get(module, [module]))
        for name in held.tensors:
            module, _ = parse_fine_tuned_lora_name(name, mapper)
            if module.rsplit(".", 1)[-1] not in expected:
                raise ApplyError(f"LoRA adapter {info.name!r}: tensor {name!r} targets "
                                 f"{module!r}, not a LoRA module of this model "
                                 f"({sorted(expected)})")
        cls = getattr(mgr, "_lora_model_cls", LoRAModel)
        # copies: vLLM scales lora_B in place when it adds the model (``optimize``), and
        # ``from_lora_tensors`` keeps a tensor as is when its dtype and device match
        return cls.from_lora_tensors(
            lora_model_id=lora_id, tensors={n: t.clone() for n, t in held.tensors.items()},
            peft_helper=helper, device="cpu",
            dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    # ------------------------------------------------------------ the commit
    def apply(self, adapters: list[AdapterVersion]) -> None:
        """Commit: hold the new versions, reload every loaded id of their names.

        All adapters are built first (a bad one is refused before anything changes)."""
        from vllm.lora.request import LoRARequest

        for held in adapters:
            self.build(held, 1)  # check only; vLLM's loads build their own
        with self._lock:
            for held in adapters:
                self._held[held.info.name] = held
            loaded = set(self._manager.list_adapters())
            self._ids = {i: n for i, n in self._ids.items() if i in loaded}
            todo = [(i, n) for i, n in self._ids.items()
                    if any(h.info.name == n for h in adapters)]
        for lora_id, name in todo:
            self._manager.add_adapter(LoRARequest(
                lora_name=name, lora_int_id=lora_id, lora_path=PLACEHOLDER_SCHEME + name,
                load_inplace=True))
            self.reloads += 1
        logger.info("weightpub: adapters %s at version %d (%d loaded ids reloaded)",
                    [h.info.name for h in adapters], adapters[0].version, len(todo))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"mode": "serve",
                    "adapters": {n: {"version": h.version, "rank": h.info.rank,
                                     "ids": sorted(i for i, m in self._ids.items() if m == n)}
                                 for n, h in self._held.items()},
                    "reloads": self.reloads}
