"""Commits under captured CUDA graphs keep every weight's storage (issue 19; needs a GPU).

Run on a GPU machine: ``python -m pytest -m gpu tests/gpu/test_cuda_graph_commits.py -q -s``.
The engine captures CUDA graphs (no ``enforce_eager``), so a commit that put new
tensors into the model would leave the graphs reading the old (or freed) memory: the
transformers oracle would see the old weights. In place, reload and prepared commits
(kernel-format shadows built on the preparer's side stream, copied in on the step
stream) are each checked by the oracle and by every parameter's and buffer's
``data_ptr``; the prepared commit's pause is printed.
"""

from __future__ import annotations

import pytest
import torch

from subscriber_ext import wait_until_applied
from tests.vllm.helpers import (
    EXT,
    FAKE_SUB,
    assert_matches_hf,
    new_weights,
    publish_to_dir,
    save_tiny,
)
from tests.vllm.storage import assert_same_storage, callable_rpcs, storages

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
KIND = "qwen2_tied"
N = 6


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker was selected on a machine without CUDA")
    from vllm import LLM

    with callable_rpcs():
        engine = LLM(model=str(save_tiny(KIND, 0, tmp_path_factory.mktemp("gpu_graphs"))),
                     dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                     gpu_memory_utilization=0.3, worker_extension_cls=EXT)
        yield engine
        del engine


@pytest.mark.parametrize(("apply_mode", "prepare"),
                         [("in_place", False), ("reload", False), ("reload", True)],
                         ids=["in_place", "reload", "prepared"])
def test_commit_keeps_storage_under_cuda_graphs(llm, tmp_path, apply_mode, prepare):
    before = storages(llm)
    llm.collective_rpc("start_weight_subscriber", args=(str(tmp_path),),
                       kwargs={"subscriber_cls": FAKE_SUB, "apply_mode": apply_mode,
                               "prepare": prepare})
    try:
        for version, seed in ((1, 71), (2, 72)):
            w = new_weights(KIND, seed)
            publish_to_dir(tmp_path, version, w)
            rank = wait_until_applied(llm, version, timeout=60, fail_on_error=True)[0]
            last = rank["commits"][-1]
            assert last["prepared"] is prepare, rank
            assert_matches_hf(llm, KIND, w, N)
            assert_same_storage(before, storages(llm))
            print(f"\n{apply_mode} prepare={prepare}: commit pause {last['seconds'] * 1e3:.2f} ms")
    finally:
        llm.collective_rpc("stop_weight_subscriber")
