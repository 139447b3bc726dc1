"""Prepared commits (kernel-format weights built off the step path, swapped at commit).

Tiny Llama (tied embeddings, GQA) at TP=1: after each prepared commit the output
equals transformers on the new weights, and the commit is a swap. The commit's
blocking time is printed next to the reload path's, not asserted (2 shared cores).
"""

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
    vllm_greedy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
N = 8


def _run_versions(llm, kind, directory, versions, prepare):
    llm.collective_rpc(
        "start_weight_subscriber",
        args=(str(directory),),
        kwargs={"subscriber_cls": FAKE_SUB, "prepare": prepare},
    )
    seconds = []
    for version, seed in versions:
        w = new_weights(kind, seed)
        publish_to_dir(directory, version, w)
        status = wait_until_applied(llm, version, timeout=30)
        for s in status:
            last = s["commits"][-1]
            assert last["version"] == version
            assert last["prepared"] is prepare, s
            assert s["last_error"] is None, s
            seconds.append(last["seconds"])
        assert_matches_hf(llm, kind, w, N)
    llm.collective_rpc("stop_weight_subscriber")
    return seconds


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny("llama", 0, tmp_path_factory.mktemp("llama_prep"))
    engine = make_llm(path, tp=1)
    yield engine
    del engine


def test_prepared_commit_matches_hf_tied(llama, tmp_path):
    assert_same(vllm_greedy(llama, N), hf_greedy("llama", new_weights("llama", 0), N))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    swap_s = _run_versions(llama, "llama", tmp_path / "a", [(1, 31), (2, 32)], True)
    status = llama.collective_rpc("weight_status")[0]
    assert status["prepare"]["prepared"] == [], status["prepare"]  # shadows freed
    reload_s = _run_versions(llama, "llama", tmp_path / "b", [(3, 33)], False)
    # a reload leaves vLLM's loader wrappers on its metadata; preparing must still load
    (tmp_path / "c").mkdir()
    swap_s += _run_versions(llama, "llama", tmp_path / "c", [(4, 34)], True)
    print(f"\ncommit blocking time: prepared swap {swap_s}, reload {reload_s}")


@pytest.fixture(scope="module")
def qwen2_tp2(tmp_path_factory):
    path = save_tiny("qwen2", 0, tmp_path_factory.mktemp("qwen2_prep"))
    engine = make_llm(path, tp=2)
    yield engine
    del engine


def test_prepared_commit_matches_hf_tp2(qwen2_tp2, tmp_path):
    """TP slicing, fused qkv (with bias) / gate_up shards, one KV head replicated on 2 ranks."""
    swap_s = _run_versions(qwen2_tp2, "qwen2", tmp_path, [(1, 41), (2, 42)], True)
    print(f"\nTP=2 commit blocking time per rank: prepared swap {swap_s}")


def test_layers_are_prepared_while_the_version_arrives(llama):
    """Real publisher and subscriber behind a slow link (~1.5 s for the version): layers
    are built as their chunks are verified, the commit is a swap, and the output is
    transformers' on the new weights."""
    from publisher import WeightPublisher
    from tests.transport.byte_relay import ByteRelay

    w = new_weights("llama", 35)
    size = sum(t.numel() * t.element_size() for t in w.values())
    with WeightPublisher("tcp://127.0.0.1:0", chunk_size=64 << 10, first_version=100) as pub:
        relay = ByteRelay.in_front_of(pub.endpoint, down_rate=size / 1.5)
        try:
            llama.collective_rpc("start_weight_subscriber", args=(relay.endpoint,),
                                 kwargs={"window_bytes": 256 << 10})
            version = pub.publish(w)
            status = wait_until_applied(llama, version, timeout=60)
            last = status[0]["commits"][-1]
            assert last["version"] == version and last["prepared"], last
            assert last["early_layers"] > 0, last  # built before the last byte arrived
            assert status[0]["prepare"]["early_layers"] >= last["early_layers"]
            assert_matches_hf(llama, "llama", w, N)
            print(f"\nprepared while arriving: {last}")
        finally:
            llama.collective_rpc("stop_weight_subscriber")
            relay.close()
