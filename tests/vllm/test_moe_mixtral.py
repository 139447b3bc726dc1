"""Tiny Mixtral: its weights reach vLLM's fused-expert layers.

The checkpoint names experts ``block_sparse_moe.experts.{e}.w1/w2/w3``; transformers 5
renames the block ``mlp`` in memory and fuses the experts. TP=1 and TP=2; the checks
are in ``moe_cases.py``, one engine per TP size.
"""

from __future__ import annotations

import pytest

from .helpers import shut_down
from .moe_cases import malformed_expert_rejected, start_engine, three_versions

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "mixtral"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request, tmp_path_factory):
    engine = start_engine(KIND, request.param, tmp_path_factory)
    yield engine
    shut_down(engine)


def test_three_versions_per_expert_names_then_publish_model_then_prepared(llm):
    three_versions(llm, KIND, seed=11)


def test_malformed_expert_tensor_rejected_weights_unchanged(llm, request):
    malformed_expert_rejected(llm, KIND, seed=21, tp=request.node.callspec.params["llm"])


def test_vllm_fused_checkpoint_names_split_by_the_layers_mapping(llm):
    """A natively fused checkpoint (vLLM's ``experts.w13`` [experts, 2 x inter, hidden] and
    ``experts.w2`` for Mixtral) is split per expert by the layer's own expert mapping:
    transformers has no conversion for these names."""
    import torch

    from .helpers import assert_matches_hf, checkpoint_form, encode_all, new_weights

    weights = new_weights(KIND, 31)
    fused = checkpoint_form(KIND, weights)
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts."
        experts = range(4)
        fused[p + "w13"] = torch.stack([
            torch.cat([fused.pop(f"{p}{e}.w1.weight"), fused.pop(f"{p}{e}.w3.weight")])
            for e in experts])
        fused[p + "w2"] = torch.stack([fused.pop(f"{p}{e}.w2.weight") for e in experts])
    assert not any(".experts.0." in n for n in fused)
    llm.collective_rpc("http_load_weights_batch", args=(encode_all(fused),))
    assert_matches_hf(llm, KIND, weights, 6)
