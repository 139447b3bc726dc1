"""LoRA adapter versions merged into an engine started without LoRA (``lora_mode``
"auto" picks "merge"): the shared tiny Qwen2 TP=1 engine, after the modules before it
(which leave other weights in it: the base is published back first)."""

from __future__ import annotations

import pytest

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied

from .helpers import assert_matches_hf, assert_same, hf_greedy
from .lora_cases import BASE, KIND, N, generate, lora_tensors, merged, spec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture
def llm(qwen2_tp1_engine):
    return qwen2_tp1_engine


def test_auto_mode_merges_each_version_into_the_base(llm):
    with WeightPublisher("tcp://127.0.0.1:0") as weights:  # the checkpoint's weights back
        llm.collective_rpc("start_weight_subscriber", args=(weights.endpoint,))
        version = weights.publish(BASE)
        wait_until_applied(llm, version, publisher_id=weights.publisher_id,
                           fail_on_error=True)
        assert_matches_hf(llm, KIND, BASE, N)
        llm.collective_rpc("stop_weight_subscriber")
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        for seed in (61, 62, 63):
            adapter = lora_tensors(seed)
            version = pub.publish(adapter, adapter=spec("policy"))
            rank = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                      fail_on_error=True)[0]
            assert rank["lora"] == {"mode": "merge", "merged": {"policy": version}}
            llm.reset_prefix_cache()
            assert_same(generate(llm, None), hf_greedy(KIND, merged(adapter), N))
        llm.collective_rpc("stop_weight_subscriber")
