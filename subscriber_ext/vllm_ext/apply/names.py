"""Map the tensor names a trainer sends onto vLLM parameters.

Why: trainers name tensors the way their framework wraps the model (PEFT adds
``base_model.model.``, LoRA wrappers add ``.base_layer.``), checkpoints name
q/k/v and gate/up separately, and vLLM fuses them (``qkv_proj`` with shard ids
``q``/``k``/``v``, ``gate_up_proj`` with shard 0/1) and may itself wrap a
module for LoRA (``qkv_proj.base_layer.weight``). The model's own
``hf_to_vllm_mapper`` / ``packed_modules_mapping`` are used first; the tables
here are only fallbacks. Per-expert MoE tensors are placed by the fused-expert
layer's own mapping (``experts.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from subscriber_ext.vllm_ext.apply.experts import ExpertIndex
from weightpub_wire.errors import ApplyError

__all__ = [
    "IGNORED_SUFFIXES",
    "PEFT_PREFIXES",
    "VLM_PREFIX_REMAPS",
    "NameResolver",
    "Target",
    "normalize_checkpoint_name",
]

#: Prefixes a PEFT-wrapped trainer model adds in front of the checkpoint name.
PEFT_PREFIXES: tuple[str, ...] = ("base_model.model.",)

#: Fallback prefix remaps for vision-language models whose vLLM class has no
#: ``hf_to_vllm_mapper`` (checkpoint prefix -> vLLM prefix). Tried in order,
#: only when the name is not found as is.
VLM_PREFIX_REMAPS: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
)

#: Checkpoint tensors vLLM never loads (recomputed buffers); accepted and ignored.
IGNORED_SUFFIXES: tuple[str, ...] = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)

ShardId = str | int | None


def normalize_checkpoint_name(name: str) -> str:
    """Strip trainer-side wrappers so the name is the plain HF checkpoint name."""
    for prefix in PEFT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lands in the vLLM model."""

    checkpoint_name: str  # normalized HF name (what ``model.load_weights`` accepts)
    param_name: str  # vLLM parameter name as in ``model.named_parameters()``
    module_name: str  # owning module of the parameter
    attr: str  # attribute name of the parameter on that module
    shard_id: ShardId  # fused shard id for the parameter's weight_loader, or None
    #: MoE experts: the logical expert (as named in the checkpoint), the physical
    #: expert ids holding it, and the ``weight_name`` the layer's loader expects
    expert: int | None = None
    physical: tuple[int, ...] = ()
    loader_name: str = ""

    @property
    def part(self) -> tuple[str, ShardId, int | None]:
        """What this tensor fills: (parameter attr, shard, expert)."""
        return (self.attr, self.shard_id, self.expert)


def _stacked_from_packed(packed: Mapping[str, list[str]]) -> list[tuple[str, str, ShardId]]:
    """Turn ``packed_modules_mapping`` into (checkpoint part, fused name, shard id)."""
    out: list[tuple[str, str, ShardId]] = []
    for fused, parts in packed.items():
        letters = len(parts) == 3 and all(p.endswith(("q_proj", "k_proj", "v_proj")) for p in parts)
        for i, part in enumerate(parts):
            shard: ShardId = "qkv"[i] if letters else i
            out.append((part, fused, shard))
    return out


class NameResolver:
    """Resolve checkpoint names against one loaded vLLM model (built once, reused)."""

    def __init__(self, model: torch.nn.Module, experts: ExpertIndex | None = None) -> None:
        self.model = model
        self.params: dict[str, torch.nn.Parameter] = dict(
            model.named_parameters(remove_duplicate=False)
        )
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.stacked = _stacked_from_packed(getattr(model, "packed_modules_mapping", {}) or {})
        self.experts = experts if experts is not None else ExpertIndex(model)

    def _find_param(self, name: str) -> str | None:
        if name in self.params:
            return name
        module, _, attr = name.rpartition(".")
        wrapped = f"{module}.base_layer.{attr}"  # vLLM LoRA-wrapped module
        return wrapped if wrapped in self.params else None

    def _apply_stacked(self, name: str, shard: ShardId) -> tuple[str, ShardId]:
        if shard is not None:
            return name, shard
        for part, fused, sid in self.stacked:
            token = f".{part}."
            if token in name:
                return name.replace(token, f".{fused}.", 1), sid
        return name, None

    def vllm_names(self, ckpt: str) -> list[tuple[str, ShardId]] | None:
        """Candidate vLLM names of a checkpoint name, before stacking (None: dropped)."""
        names: list[tuple[str, ShardId]] = []
        if self.mapper is not None:
            mapped = self.mapper._map_name_with_shard(ckpt)
            if mapped is None:
                return None  # the model's own mapper drops this tensor
            m_name, m_shard = mapped
            if isinstance(m_shard, list):
                raise ApplyError(f"tensor {ckpt!r}: multi-shard targets are not supported")
            names.append((m_name, m_shard))
        names.append((ckpt, None))
        for old, new in VLM_PREFIX_REMAPS:
            if ckpt.startswith(old):
                names.append((new + ckpt[len(old) :], None))
        return names

    def resolve(self, name: str) -> Target | None:
        """Return the target of ``name``; ``None`` if vLLM ignores it; raise if unknown."""
        ckpt = normalize_checkpoint_name(name)
        if ckpt.endswith(IGNORED_SUFFIXES):
            return None
        names = self.vllm_names(ckpt)
        if names is None:
            return None
        if self.experts:
            for cand, _ in names:
                placed = self.experts.place(cand)
                if placed is not None:
                    layer, slot = placed
                    return Target(
                        ckpt, f"{layer.path}.{slot.attr}", layer.path, slot.attr, slot.shard,
                        expert=slot.expert, physical=slot.physical, loader_name=slot.loader_name,
                    )
        candidates = [self._apply_stacked(cand, shard) for cand, shard in names]
        for cand, shard in candidates:
            found = self._find_param(cand)
            if found is not None:
                module, _, attr = found.rpartition(".")
                return Target(ckpt, found, module, attr, shard)
        if self._missing_on_this_pp_rank(candidates[0][0]):
            return None
        raise ApplyError(f"tensor {name!r}: the model has no parameter for it")

    def _missing_on_this_pp_rank(self, name: str) -> bool:
        try:
            from vllm.model_executor.models.utils import is_pp_missing_parameter
        except ImportError:  # pragma: no cover - older vLLM
            return False
        try:
            return bool(is_pp_missing_parameter(name, self.model))
        except Exception:
            return False
