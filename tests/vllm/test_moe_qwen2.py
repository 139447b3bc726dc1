"""Tiny Qwen2-MoE with a shared expert: its weights reach vLLM's fused-expert layers.

Besides the routed experts: ``mlp.shared_expert.*`` (a dense MLP next to them) and its
sigmoid gate ``mlp.shared_expert_gate``. TP=1 and TP=2; the checks are in
``moe_cases.py``, one engine per TP size.
"""

from __future__ import annotations

import pytest

from .helpers import shut_down
from .moe_cases import malformed_expert_rejected, start_engine, three_versions

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2_moe"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request, tmp_path_factory):
    engine = start_engine(KIND, request.param, tmp_path_factory)
    yield engine
    shut_down(engine)


def test_three_versions_per_expert_names_then_publish_model_then_prepared(llm):
    three_versions(llm, KIND, seed=11)


def test_malformed_expert_tensor_rejected_weights_unchanged(llm, request):
    malformed_expert_rejected(llm, KIND, seed=21, tp=request.node.callspec.params["llm"])
