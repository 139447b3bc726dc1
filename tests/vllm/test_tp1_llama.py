"""TP=1 tiny Llama with tied embeddings: the subscriber path gives transformers' output."""

from __future__ import annotations

import pytest

from subscriber_ext import wait_until_applied

from .helpers import (
    FAKE_SUB,
    assert_matches_hf,
    assert_same,
    hf_greedy,
    make_llm,
    new_weights,
    publish_to_dir,
    save_tiny,
    shut_down,
    vllm_greedy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "llama"
N = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny(KIND, 0, tmp_path_factory.mktemp("llama"))
    engine = make_llm(path, tp=1)
    yield engine
    shut_down(engine)


def test_llama_subscriber_versions(llm, tmp_path):
    assert_same(vllm_greedy(llm, N), hf_greedy(KIND, new_weights(KIND, 0), N))
    llm.collective_rpc(
        "start_weight_subscriber", args=(str(tmp_path),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    for version, seed in ((1, 21), (2, 22)):
        w = new_weights(KIND, seed)
        publish_to_dir(tmp_path, version, w)
        wait_until_applied(llm, version, timeout=20)
        assert_matches_hf(llm, KIND, w, N)
    llm.collective_rpc("stop_weight_subscriber")
