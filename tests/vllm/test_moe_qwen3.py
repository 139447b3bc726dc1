"""Tiny Qwen3-MoE (4 experts, top-2): its weights reach vLLM's fused-expert layers.

TP=1 only, to keep the MoE tests near their CI budget (3 minutes on 2 cores): Qwen3-MoE
goes through the same transformers conversion (``qwen3_moe`` is an alias of
``qwen2_moe`` in ``conversion_mapping.py``) and the same vLLM fused-expert layer as
Qwen2-MoE, which runs at TP=2 (``test_moe_qwen2.py``), as does Mixtral. Adding
``2`` to the params costs one more engine start (25-45 s measured on 2 shared cores).
The checks are in ``moe_cases.py``.
"""

from __future__ import annotations

import pytest

from .helpers import shut_down
from .moe_cases import malformed_expert_rejected, start_engine, three_versions
from .storage import assert_same_storage, callable_rpcs, storages

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen3_moe"


@pytest.fixture(scope="module", params=[1], ids=["tp1"])
def llm(request, tmp_path_factory):
    with callable_rpcs():  # storages(): a callable in collective_rpc
        engine = start_engine(KIND, request.param, tmp_path_factory)
        yield engine
        shut_down(engine)


def test_three_versions_per_expert_names_then_publish_model_then_prepared(llm):
    """... and every parameter and buffer keeps its storage (reload and prepared commits of
    the fused experts; captured CUDA graphs keep reading it)."""
    before = storages(llm)
    three_versions(llm, KIND, seed=11)
    assert_same_storage(before, storages(llm))


def test_malformed_expert_tensor_rejected_weights_unchanged(llm, request):
    malformed_expert_rejected(llm, KIND, seed=21, tp=request.node.callspec.params["llm"])
