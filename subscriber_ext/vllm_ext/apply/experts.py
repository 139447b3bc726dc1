"""Place checkpoint expert tensors in vLLM's fused-expert (FusedMoE) layers.

Why: vLLM keeps every expert of a MoE layer in two stacked parameters of one
``RoutedExperts`` module (``w13_weight`` [experts, 2 x intermediate, hidden],
``w2_weight`` [experts, hidden, intermediate]), while a checkpoint names each
expert's projection (Qwen-MoE ``mlp.experts.3.gate_proj.weight``, Mixtral
``block_sparse_moe.experts.3.w1.weight``) or, for natively fused checkpoints,
all experts at once (``mlp.experts.gate_up_proj``). Which checkpoint name goes
where is the layer's own mapping (``RoutedExperts.get_expert_mapping``, what
its ``load_weights`` uses: the model's projection names, EPLB replicas of a
logical expert, the fused entries), so nothing here names a projection. The
layer's ``weight_loader(param, tensor, weight_name, shard_id, expert_id)``
does the TP slicing; the checkpoint shape of one expert comes from its
``moe_config``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from weightpub_wire.errors import ApplyError

__all__ = ["ExpertIndex", "ExpertLayer", "ExpertSlot", "routed_experts_class"]

_EXPERT_ID = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def routed_experts_class() -> type[torch.nn.Module] | None:
    """vLLM's module holding a MoE layer's expert weights (None without vLLM)."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # pragma: no cover - vLLM without the fused-MoE layer
        return None
    return RoutedExperts


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert checkpoint tensor lands."""

    attr: str  # parameter on the RoutedExperts module (``w13_weight``)
    shard: str  # ``w1`` (gate), ``w3`` (up) or ``w2`` (down)
    expert: int  # logical expert id, as in the checkpoint name
    physical: tuple[int, ...]  # physical expert ids holding it (EPLB replicas)
    loader_name: str  # the ``weight_name`` vLLM's own load passes to the loader


class ExpertLayer:
    """One ``RoutedExperts`` module and its checkpoint mapping."""

    def __init__(self, path: str, module: torch.nn.Module) -> None:
        self.path = path  # the RoutedExperts module
        self.parent = path.rpartition(".")[0]  # the module checkpoint names hang off
        mod: Any = module  # vLLM's RoutedExperts (its attributes are untyped)
        self.module = mod
        self.leaf = self.parent.rpartition(".")[2] + "."  # "experts."
        # weight_name ("experts.3.gate_proj.") -> [(param prefix "experts.w13_", physical, shard)]
        self.per_expert: dict[str, list[tuple[str, int, str]]] = {}
        for param, weight_name, physical, shard in mod.get_expert_mapping():
            self.per_expert.setdefault(weight_name, []).append((param, physical, shard))
        #: every (param prefix, shard, logical expert) a complete load of the layer needs
        self.parts: dict[str, set[tuple[str, int]]] = {}
        self.logical: set[int] = set()  # the layer's logical expert ids
        for weight_name, entries in self.per_expert.items():
            expert = _logical_id(weight_name)
            self.logical.add(expert)
            for param, _, shard in entries:
                self.parts.setdefault(_strip(param, self.leaf), set()).add((shard, expert))
        self.fused: dict[str, list[tuple[str, int, str]]] = {}
        for param, weight_name, index, shard in mod.get_expert_mapping(include_fused=True):
            if _EXPERT_ID.search(weight_name + ".") is None:  # fused: every expert at once
                self.fused.setdefault(weight_name, []).append((param, index, shard))

    def local_name(self, name: str) -> str | None:
        """``name`` relative to the layer (``experts.3.gate_proj.weight``), or None."""
        if not name.startswith(self.parent + "."):
            return None
        return self.leaf + name[len(self.parent) + 1 :]

    def place(self, name: str) -> ExpertSlot | None:
        """The slot of a per-expert tensor under this layer; raise for a missing expert."""
        local = self.local_name(name)
        if local is None:
            return None
        stem, _, suffix = local.rpartition(".")
        entries = self.per_expert.get(stem + ".")
        if entries is None:
            match = _EXPERT_ID.match(local)
            if match is not None and int(match.group(1)) not in self.logical:
                raise ApplyError(
                    f"tensor {name!r}: expert {int(match.group(1))} does not exist in "
                    f"{self.parent!r} ({len(self.logical)} experts)"
                )
            return None  # not an expert tensor, or a projection the layer lacks
        param, _, shard = entries[0]
        attr = _strip(param, self.leaf) + suffix
        if attr not in self.module._parameters:
            return None  # e.g. a bias the layer does not have
        return ExpertSlot(
            attr=attr,
            shard=shard,
            expert=_logical_id(stem + "."),
            physical=tuple(p for _, p, _ in entries),
            loader_name=name.replace(stem + ".", param, 1),
        )

    def split_fused(
        self, name: str, ckpt_name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]] | None:
        """A natively fused checkpoint weight as per-expert views (``None``: not one).

        ``name`` is the vLLM-side name of ``ckpt_name``; the per-expert names
        returned keep ``ckpt_name``'s prefix. Same split as
        ``RoutedExperts.load_weights``: optional transpose
        (``is_fused_checkpoint_transposed``), gate/up halves on dim 1, experts on dim 0.
        """
        local = self.local_name(name)
        if local is None or local not in self.fused:
            return None
        if tensor.dim() != 3:
            raise ApplyError(
                f"tensor {name!r}: a fused expert weight has 3 dimensions "
                f"[experts, out, in], got shape {tuple(tensor.shape)}"
            )
        weight = tensor
        if getattr(self.module, "is_fused_checkpoint_transposed", False):
            weight = tensor.transpose(-1, -2)
        gated = bool(self.module.moe_config.is_act_and_mul)
        tail = local[len(self.leaf) :]  # "gate_up_proj"
        source = ckpt_name if ckpt_name.endswith("." + tail) else name
        head = source[: len(source) - len(tail)]  # "....experts."
        out: list[tuple[str, torch.Tensor]] = []
        for _, index, shard in self.fused[local]:
            part = weight.chunk(2, dim=1)[index] if shard in ("w1", "w3") and gated else weight
            proj = self._ckpt_proj(shard)
            views = enumerate(part.unbind(0))
            out.extend((f"{head}{expert}.{proj}.weight", view) for expert, view in views)
        return out

    def _ckpt_proj(self, shard: str) -> str:
        attr = {"w1": "ckpt_gate_proj_name", "w2": "ckpt_down_proj_name", "w3": "ckpt_up_proj_name"}
        return str(getattr(self.module, attr[shard]))

    def expected_shape(self, attr: str, shard: str) -> tuple[int, ...] | None:
        """Checkpoint shape of one expert's ``shard`` of ``attr`` (unquantized layers)."""
        cfg = self.module.moe_config
        qm = getattr(self.module, "quant_method", None)
        if qm is not None and not type(qm).__name__.startswith("Unquantized"):
            return None
        if getattr(cfg, "intermediate_pad", None):
            return None
        inter = int(cfg.intermediate_size)
        hidden = int(cfg.hidden_dim_unpadded or cfg.hidden_dim)
        if attr.endswith("_weight") and not attr.endswith("scale_weight"):
            return (inter, hidden) if shard in ("w1", "w3") else (hidden, inter)
        if attr.endswith("_bias"):
            return (inter,) if shard in ("w1", "w3") else (hidden,)
        return None

    def needed_parts(self, attr: str) -> list[tuple[str, int]]:
        """Every (shard, logical expert) of ``attr`` a complete load needs."""
        for prefix, parts in self.parts.items():
            if attr.startswith(prefix):
                return sorted(parts, key=lambda p: (p[1], p[0]))
        return []


class ExpertIndex:
    """Every fused-expert layer of a model, found by module type (built once: the
    modules and their mappings outlive the parameter objects a reload replaces)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cls = routed_experts_class()
        self.layers: dict[str, ExpertLayer] = {}  # by RoutedExperts path
        self.by_parent: dict[str, ExpertLayer] = {}  # by the path checkpoint names use
        if cls is None:
            return
        for path, module in model.named_modules():
            if isinstance(module, cls):
                layer = ExpertLayer(path, module)
                self.layers[path] = layer
                self.by_parent[layer.parent] = layer

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __iter__(self) -> Iterator[ExpertLayer]:
        return iter(self.layers.values())

    def layer_of(self, name: str) -> ExpertLayer | None:
        """The layer whose checkpoint names ``name`` falls under (longest match)."""
        end = len(name)
        while (end := name.rfind(".", 0, end)) > 0:
            layer = self.by_parent.get(name[:end])
            if layer is not None:
                return layer
        return None

    def place(self, name: str) -> tuple[ExpertLayer, ExpertSlot] | None:
        layer = self.layer_of(name)
        if layer is None:
            return None
        slot = layer.place(name)
        return None if slot is None else (layer, slot)


def _logical_id(weight_name: str) -> int:
    match = _EXPERT_ID.search(weight_name)
    if match is None:  # pragma: no cover - vLLM's per-expert names always carry it
        raise ApplyError(f"expert mapping entry {weight_name!r} has no expert id")
    return int(match.group(1))


def _strip(param: str, leaf: str) -> str:
    return param[len(leaf) :] if param.startswith(leaf) else param
