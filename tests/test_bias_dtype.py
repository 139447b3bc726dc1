"""The dtype a linear layer's bias is checked against is the one the model created it in,
not the kernel's (no engine: one real vLLM layer).

Why: vLLM records no reload metadata for ``bias``, and on a CPU with AMX its small-GEMM
path (``dispatch_cpu_unquantized_gemm``) keeps the bias of a bf16 layer in float32; the
check then refused every bf16 bias a bf16 engine's loader takes (found by the bf16 TP=2
LoRA merge: ``'k_proj.bias': dtype torch.bfloat16 but the model expects torch.float32``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from subscriber_ext.vllm_ext.apply.names import NameResolver
from subscriber_ext.vllm_ext.apply.shapes import expected_dtype
from subscriber_ext.vllm_ext.apply.spec_checks import SpecChecker, TensorSpec
from weightpub_wire.errors import ApplyError


@pytest.fixture(scope="module")
def tp1() -> Iterator[None]:
    """vLLM's parameters ask the tensor-parallel group for their rank: a world of one
    (gloo on loopback), torn down after the module."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def attention(dtype: torch.dtype) -> Any:
    """Qwen2's fused ``qkv_proj`` (with a bias) as a loaded model has it: reload metadata
    recorded at creation, then the CPU kernel's processing."""
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model: Any = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model.attn = torch.nn.Module()
    layer: Any = QKVParallelLinear(128, 64, 2, 1, bias=True, params_dtype=dtype)
    model.attn.qkv_proj = layer
    record_metadata_for_reloading(model)
    layer.quant_method.process_weights_after_loading(layer)
    if dtype == torch.bfloat16 and layer.bias.dtype == dtype:  # a CPU without AMX tiles:
        layer.bias.data = layer.bias.to(torch.float32)  # what vLLM's AMX path does
    return model


def test_a_bf16_bias_kept_in_float32_by_the_kernel_is_expected_in_bf16(tp1: None) -> None:
    model = attention(torch.bfloat16)
    layer: Any = model.attn.qkv_proj
    assert layer.bias.dtype == torch.float32  # the kernel's dtype: the case at hand
    assert expected_dtype(layer, "bias", layer.bias) == torch.bfloat16
    assert expected_dtype(layer, "weight", layer.weight) == torch.bfloat16
    checker = SpecChecker(model, NameResolver(model), lambda: "in_place")
    bias = TensorSpec("attn.k_proj.bias", torch.bfloat16, (64,))
    [(_, target)] = checker.check([bias], whole_layers=False)
    assert target is not None and target.shard_id == "k"
    with pytest.raises(ApplyError, match=r"k_proj.bias'.*float32 but the model expects "
                                         r"torch.bfloat16"):
        checker.check([TensorSpec("attn.k_proj.bias", torch.float32, (64,))], False)


def test_a_float32_bias_is_expected_in_float32(tp1: None) -> None:
    model = attention(torch.float32)
    layer: Any = model.attn.qkv_proj
    assert expected_dtype(layer, "bias", layer.bias) == torch.float32
    checker = SpecChecker(model, NameResolver(model), lambda: "in_place")
    with pytest.raises(ApplyError, match="bfloat16 but the model expects torch.float32"):
        checker.check([TensorSpec("attn.q_proj.bias", torch.bfloat16, (128,))], False)
