"""Merge a published LoRA adapter into the base weights (engines without LoRA enabled).

Why: an engine started without ``enable_lora`` cannot serve adapters, and merging
costs nothing per token. Each commit writes, for every targeted module,
``W = W_base + scale * B @ A`` through the ordinary commit path (``WeightApplier``:
checked first, all or nothing, vLLM's loaders). ``W_base`` is read from the served
checkpoint each time (safetensors, memory-mapped; never the live weights, which may
already hold the previous adapter version), so versions replace each other instead of
adding up. The reload path needs whole layers: the other modules packed with a target
(``k_proj``/``v_proj`` beside ``q_proj`` in ``qkv_proj``) and their biases are read
from the checkpoint too.

One adapter is merged: the one named by the ``merge_adapter`` option, or the only one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.applier import WeightApplier
from subscriber_ext.vllm_ext.apply.names import PEFT_PREFIXES
from subscriber_ext.vllm_ext.lora.adapter_versions import AdapterVersion
from weightpub_wire.errors import ApplyError

__all__ = ["AdapterMerger"]

logger = logging.getLogger("weightpub.lora")


def _module_of(peft_name: str) -> tuple[str, str] | None:
    """``base_model.model.X.lora_A.weight`` -> (``X``, ``"A"``); None for other names."""
    for prefix in PEFT_PREFIXES:
        if peft_name.startswith(prefix):
            peft_name = peft_name[len(prefix):]
    for part in ("A", "B"):
        tail = f".lora_{part}.weight"
        if peft_name.endswith(tail):
            return peft_name[: -len(tail)], part
    return None


class AdapterMerger:
    """Writes ``base + scale * B @ A`` of one adapter into one rank's model."""

    def __init__(self, applier: WeightApplier, checkpoint_dir: str | os.PathLike[str],
                 adapter: str | None = None) -> None:
        self.applier = applier
        self._dir = Path(checkpoint_dir)
        self.adapter = adapter
        self._files: dict[str, Path] | None = None  # checkpoint tensor name -> file
        self.merged: dict[str, int] = {}  # adapter -> version merged

    def _index(self) -> dict[str, Path]:
        if self._files is None:
            from safetensors import safe_open

            if not self._dir.is_dir():
                raise ApplyError(f"lora merge: the base checkpoint {str(self._dir)!r} is not "
                                 "a local directory (merging needs the base weights)")
            files: dict[str, Path] = {}
            for path in sorted(self._dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    files.update(dict.fromkeys(f.keys(), path))
            if not files:
                raise ApplyError(f"lora merge: no *.safetensors in {str(self._dir)!r}")
            self._files = files
        return self._files

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        index = self._index()
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(index[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, group in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in group:
                    out[name] = f.get_tensor(name)
        return out

    def choose(self, adapters: list[AdapterVersion]) -> AdapterVersion:
        if self.adapter is not None:
            for held in adapters:
                if held.info.name == self.adapter:
                    return held
            raise ApplyError(f"lora merge: adapter {self.adapter!r} is not in version "
                             f"{adapters[0].version} ({[a.info.name for a in adapters]})")
        if len(adapters) != 1:
            raise ApplyError(f"lora merge: version {adapters[0].version} has adapters "
                             f"{[a.info.name for a in adapters]}; name one with the "
                             "merge_adapter option")
        return adapters[0]

    def merged_tensors(self, held: AdapterVersion) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors: merged targets, plus their packed siblings as is."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in held.tensors.items():
            found = _module_of(name)
            if found is None:
                raise ApplyError(f"lora merge: tensor {name!r} of adapter "
                                 f"{held.info.name!r} is not a lora_A/lora_B weight")
            pairs.setdefault(found[0], {})[found[1]] = tensor
        index = self._index()
        targets = {}
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise ApplyError(f"lora merge: module {module!r} of adapter "
                                 f"{held.info.name!r} lacks lora_{'AB'[len(ab) % 2]}")
            if f"{module}.weight" not in index:
                raise ApplyError(f"lora merge: adapter {held.info.name!r} targets {module!r}, "
                                 "which has no weight in the base checkpoint")
            targets[f"{module}.weight"] = ab
        wanted = set(targets) | self._siblings(set(targets), index)
        base = self._read(sorted(wanted))
        scale = held.info.scale
        served = self._served_dtype()
        for name, w in base.items():
            if name in targets:
                a, b = targets[name]["A"].float(), targets[name]["B"].float()
                if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
                    raise ApplyError(f"lora merge: {name}: B {list(b.shape)} @ A "
                                     f"{list(a.shape)} does not make the weight "
                                     f"{list(w.shape)}")
                w = w.float() + scale * (b @ a)  # in float32, rounded once below
            # the checkpoint's dtype may not be the served one (fp32 file, bf16 engine)
            base[name] = w.to(served) if served is not None and w.is_floating_point() else w
        return base

    def _served_dtype(self) -> torch.dtype | None:
        dtype = getattr(getattr(self.applier.vllm_config, "model_config", None), "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _siblings(self, targets: set[str], index: dict[str, Path]) -> set[str]:
        """Checkpoint tensors of every module that shares a vLLM layer with a target."""
        packed = getattr(self.applier.model, "packed_modules_mapping", None) or {}
        groups = [list(members) for members in packed.values()]
        out: set[str] = set()
        for name in targets:
            module = name[: -len(".weight")]
            parent, _, leaf = module.rpartition(".")
            members = next((g for g in groups if leaf in g), [leaf])
            for member in members:
                prefix = f"{parent}.{member}." if parent else f"{member}."
                out.update(n for n in index if n.startswith(prefix))
        return out

    def apply(self, adapters: list[AdapterVersion]) -> None:
        """Commit: merge the chosen adapter's version into the live weights."""
        held = self.choose(adapters)
        self.applier.apply(self.merged_tensors(held))
        self.merged = {held.info.name: held.version}
        logger.info("weightpub: adapter %r version %d merged into the base weights",
                    held.info.name, held.version)

    def status(self) -> dict[str, Any]:
        return {"mode": "merge", "merged": dict(self.merged)}
