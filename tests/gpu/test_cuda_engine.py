"""Checks that need a CUDA GPU (deselected on CPU CI: `-m 'not gpu'`).

Run on a GPU machine with the `gpu` extra installed:
    python -m pytest -m gpu tests/gpu -q -s

They exercise what the CPU backend cannot: the in-place apply path (vLLM
keeps checkpoint-layout weights on GPU, so each tensor goes through its
parameter's own weight_loader into the live parameter) and the step-loop
pause a commit costs there, printed against one device memcpy of the model.
"""

from __future__ import annotations

import time

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied
from tests.vllm.helpers import EXT, assert_matches_hf, new_weights, save_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
KIND = "qwen2"
N = 6


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker was selected on a machine without CUDA")
    from vllm import LLM

    engine = LLM(model=str(save_tiny(KIND, 0, tmp_path_factory.mktemp("gpu"))),
                 dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                 max_model_len=256, gpu_memory_utilization=0.3, worker_extension_cls=EXT)
    yield engine
    del engine


def test_in_place_apply_matches_transformers_and_reports_pause(llm):
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        status = llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))[0]
        assert status["apply_mode"] == "in_place", status
        for seed in (91, 92, 93):
            weights = new_weights(KIND, seed)
            version = pub.publish(weights)
            rank = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                      fail_on_error=True)[0]
            assert rank["applied_version"] == version
            assert_matches_hf(llm, KIND, weights, N)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        memcpy = time.perf_counter() - start
        pause = rank["commits"][-1]["seconds"]
        print(f"commit pause {pause * 1e3:.2f} ms vs device memcpy of the model "
              f"{memcpy * 1e3:.3f} ms: {pause / memcpy:.1f}x (target <= 1.5x)")
        llm.collective_rpc("stop_weight_subscriber")
