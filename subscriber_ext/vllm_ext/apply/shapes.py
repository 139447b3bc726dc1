"""Expected checkpoint (unsharded) shape and dtype of each vLLM parameter.

Why: a replica must reject a bad tensor *before* it touches any weight, and a
TP rank only holds a shard of each fused parameter, so the live shape says
little about the checkpoint shape. The full shape is rebuilt from the layer's
own bookkeeping (``input_size``/``output_size``, ``output_sizes``, head counts,
``org_vocab_size``, a MoE layer's ``moe_config``), and the dtype is the one the
model created the parameter in: vLLM's pre-processing metadata for layerwise
reload (the live tensor may be repacked to ``[0]``), or for a ``bias`` (never
recorded there) the layer's ``params_dtype``. The live dtype is the kernel's:
on a CPU with AMX vLLM keeps the bias of a small bf16/fp16 linear layer in
float32 (``dispatch_cpu_unquantized_gemm``'s SGL path), while its loader takes
the checkpoint's bf16 as any other does.
"""

from __future__ import annotations

import torch

from subscriber_ext.vllm_ext.apply.experts import ExpertLayer
from subscriber_ext.vllm_ext.apply.names import ShardId

__all__ = ["expected_dtype", "expected_shape", "loader_parts", "original_tensor"]

Part = tuple[ShardId, int | None]  # (fused shard, expert) one checkpoint tensor fills


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    base = getattr(module, "base_layer", None)  # vLLM LoRA wrapper
    return base if isinstance(base, torch.nn.Module) else module


def original_tensor(module: torch.nn.Module, attr: str) -> torch.Tensor | None:
    """The parameter as created by the model (meta tensor), before kernel repacking."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover
        return None
    info = LAYERWISE_INFO.get(module)
    if info is None:
        return None
    return info.restore_metadata[0].get(attr)


def expected_dtype(module: torch.nn.Module, attr: str, live: torch.Tensor) -> torch.dtype:
    """Checkpoint dtype the parameter's loader expects: the dtype it was created in."""
    meta = original_tensor(module, attr)
    if meta is not None:
        return meta.dtype
    created = getattr(_unwrap(module), "params_dtype", None)
    if attr == "bias" and isinstance(created, torch.dtype) and live.is_floating_point():
        return created  # vLLM records no bias (built after create_weights)
    return live.dtype


def _is_unquantized(layer: torch.nn.Module) -> bool:
    qm = getattr(layer, "quant_method", None)
    return qm is None or type(qm).__name__.startswith("Unquantized")


def expected_shape(
    module: torch.nn.Module,
    attr: str,
    shard: ShardId,
    live: torch.Tensor,
    experts: ExpertLayer | None = None,
) -> tuple[int, ...] | None:
    """Full checkpoint shape for (module.attr, shard), or None when it cannot be told.

    ``experts``: the module is a fused-expert layer; the shape is one expert's.
    """
    if experts is not None:
        return experts.expected_shape(attr, str(shard))
    from vllm.model_executor.layers.linear import (
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    layer = _unwrap(module)
    if not _is_unquantized(layer):
        return None
    if isinstance(layer, VocabParallelEmbedding):
        if attr == "weight":
            return (layer.org_vocab_size, layer.embedding_dim)
        return None
    if isinstance(layer, LinearBase) and attr in ("weight", "bias"):
        if isinstance(layer, QKVParallelLinear):
            sizes = {
                "q": layer.total_num_heads * layer.head_size,
                "k": layer.total_num_kv_heads * layer.head_size,
                "v": layer.total_num_kv_heads * layer.v_head_size,
            }
            rows = sum(sizes.values()) if shard is None else sizes.get(str(shard))
        elif isinstance(layer, MergedColumnParallelLinear):
            if shard is None:
                rows = sum(layer.output_sizes)
            elif isinstance(shard, int) and 0 <= shard < len(layer.output_sizes):
                rows = layer.output_sizes[shard]
            else:
                rows = None
        else:
            rows = layer.output_size
        if rows is None:
            return None
        return (rows, layer.input_size) if attr == "weight" else (rows,)
    meta = original_tensor(module, attr)
    ref = meta if meta is not None else live
    if getattr(ref, "output_dim", None) is None and getattr(ref, "input_dim", None) is None:
        return tuple(ref.shape)  # not sharded: checkpoint shape == parameter shape
    return None


def loader_parts(
    module: torch.nn.Module, attr: str, experts: ExpertLayer | None = None
) -> list[Part]:
    """Every (shard, expert) a complete load of module.attr needs (``[(None, None)]``
    if not fused)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if experts is not None:
        return list(experts.needed_parts(attr))
    layer = _unwrap(module)
    if isinstance(layer, QKVParallelLinear):
        return [("q", None), ("k", None), ("v", None)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(i, None) for i in range(len(layer.output_sizes))]
    return [(None, None)]
