"""Turn what a trainer publishes into checkpoint-format tensors before they are placed.

Why: transformers >= 5 keeps some modules in another layout in memory than in its
checkpoints (MoE experts fused into ``mlp.experts.gate_up_proj`` [experts,
2 x intermediate, hidden] and ``mlp.experts.down_proj``; Mixtral's
``block_sparse_moe`` renamed ``mlp``), trainers publish ``model.state_dict()``,
and vLLM loads checkpoint names. transformers keeps that mapping itself
(``conversion_mapping.py``) and ``save_pretrained`` applies it in reverse
(``core_model_loading.revert_weight_conversion``); we apply the same reverse, on a
meta-device skeleton of the served model built once from its config, to every
tensor the model cannot place as it is. What is still unplaced and is a natively
fused checkpoint tensor (vLLM's ``experts.gate_up_proj`` entries) is split per
expert by the vLLM layer's own mapping (``experts.py``). The results are views of
the published tensors (renames, chunks, unbinds, transposes), never copies.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.names import NameResolver, normalize_checkpoint_name
from weightpub_wire.errors import ApplyError

__all__ = ["CheckpointLayout", "Converted", "build_skeleton"]

logger = logging.getLogger("weightpub.apply")


@dataclass(frozen=True)
class Converted:
    """One checkpoint-format tensor and the published tensor it came from."""

    name: str
    tensor: torch.Tensor
    source: str | None = None  # the published name, when the layout was converted


def build_skeleton(hf_config: Any) -> torch.nn.Module:
    """The transformers model of ``hf_config`` on the meta device (no memory, no init).

    Why: transformers finds a model's conversions by walking its sub-models
    (``get_model_conversion_mapping``), so it needs the module tree, not weights.
    """
    import transformers

    config = copy.deepcopy(hf_config)
    classes = [getattr(transformers, a, None) for a in (config.architectures or [])]
    with torch.device("meta"):
        for cls in classes:
            if isinstance(cls, type) and hasattr(cls, "_from_config"):
                try:
                    return cls._from_config(config)
                except Exception as exc:  # try the next class, then the Auto class
                    logger.debug("weightpub: skeleton %s failed: %s", cls.__name__, exc)
        return transformers.AutoModelForCausalLM.from_config(config)


class CheckpointLayout:
    """Converts published tensors to checkpoint names/layouts for one served model.

    Kept for the model's life (it holds the skeleton); the resolver is passed per
    call because a reload replaces the parameters it indexes.
    """

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self._skeleton: torch.nn.Module | None = None
        self._skeleton_failed = False
        self._lock = threading.Lock()

    def to_checkpoint(
        self, items: Iterable[tuple[str, torch.Tensor]], resolver: NameResolver
    ) -> list[Converted]:
        """Every published tensor as checkpoint tensors (unplaceable ones unchanged)."""
        out: list[Converted] = []
        for name, tensor in items:
            ckpt = normalize_checkpoint_name(name)
            if _placeable(resolver, ckpt):
                out.append(Converted(ckpt, tensor))
                continue
            for new_name, new_tensor in self._revert(name, ckpt, tensor):
                split = None
                if not _placeable(resolver, new_name):
                    split = _split_fused(resolver, new_name, new_tensor)
                if split is None:
                    src = None if new_name == ckpt else name
                    out.append(Converted(new_name, new_tensor, src))
                else:
                    out.extend(Converted(n, t, name) for n, t in split)
        return out

    # ------------------------------------------------------------ transformers
    def skeleton(self) -> torch.nn.Module | None:
        with self._lock:  # the commit path and the preparer thread may both ask
            if self._skeleton is None and not self._skeleton_failed:
                self._build_skeleton()
        return self._skeleton

    def _build_skeleton(self) -> None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange

            skeleton = build_skeleton(self.hf_config)
            # what revert_weight_conversion computes per call for a model built from
            # scratch (it walks every module), computed once
            conversions = get_model_conversion_mapping(skeleton, add_legacy=False)
            skeleton._weight_conversions = [  # type: ignore[assignment]
                c for c in conversions if not isinstance(c, PrefixChange)
            ]
            self._skeleton = skeleton
        except Exception as exc:
            self._skeleton_failed = True
            logger.warning(
                "weightpub: no transformers skeleton for %s (%s); tensors in "
                "transformers' in-memory layout cannot be converted",
                getattr(self.hf_config, "architectures", None), exc,
            )

    def _revert(
        self, name: str, ckpt: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        skeleton = self.skeleton()
        if skeleton is None or not getattr(skeleton, "_weight_conversions", None):
            return [(ckpt, tensor)]
        from transformers.core_model_loading import revert_weight_conversion

        try:
            reverted = revert_weight_conversion(skeleton, {ckpt: tensor})
        except Exception as exc:
            raise ApplyError(
                f"tensor {name!r} (shape {tuple(tensor.shape)}): transformers cannot convert "
                f"it from its in-memory layout to the checkpoint's: {exc}"
            ) from exc
        return list(reverted.items())


def _placeable(resolver: NameResolver, name: str) -> bool:
    try:
        resolver.resolve(name)
    except ApplyError:
        return False
    return True


def _split_fused(
    resolver: NameResolver, ckpt: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]] | None:
    """vLLM's fused checkpoint layout, per expert, by the layer's own mapping."""
    if not resolver.experts:
        return None
    for cand, _ in resolver.vllm_names(ckpt) or []:
        layer = resolver.experts.layer_of(cand)
        if layer is not None:
            split = layer.split_fused(cand, ckpt, tensor)
            if split is not None:
                return split
    return None
