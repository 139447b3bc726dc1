"""LoRA-enabled engine: vLLM wraps layers (`...qkv_proj.base_layer.weight`), and the
trainer sends PEFT names (`base_model.model.` prefix, `.base_layer.` inside)."""

from __future__ import annotations

import pytest

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied

from .helpers import assert_matches_hf, make_llm, new_weights, save_tiny, shut_down

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6


def peft_names(weights: dict) -> dict:
    """How a PEFT-wrapped trainer names the base weights of LoRA-targeted layers."""
    out = {}
    for name, tensor in weights.items():
        for proj in ("q_proj", "v_proj", "gate_proj"):
            name = name.replace(f".{proj}.weight", f".{proj}.base_layer.weight")
        out["base_model.model." + name] = tensor
    return out


def test_lora_wrapped_engine_takes_peft_named_weights(tmp_path):
    llm = make_llm(save_tiny(KIND, 0, tmp_path / "m"), tp=1, enable_lora=True,
                   max_lora_rank=8, max_loras=1)
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        weights = new_weights(KIND, 81)
        sent = peft_names(weights)
        assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in sent
        version = pub.publish(sent)
        rank = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                  fail_on_error=True)[0]
        assert rank["last_error"] is None and rank["applied_version"] == version
        assert_matches_hf(llm, KIND, weights, N)
        llm.collective_rpc("stop_weight_subscriber")
    shut_down(llm)  # not waited for here (a failed test leaves it to the garbage collector)
