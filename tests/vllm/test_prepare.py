"""Prepared commits (kernel-format weights built off the step path, copied in at commit).

Tiny Llama (tied embeddings, GQA) at TP=1 and a tied Qwen2 at TP=2: after each prepared
commit the output equals transformers on the new weights, and every parameter and
buffer keeps its storage (captured CUDA graphs keep reading it), in every mode. A
trainer that sends the tied ``lm_head.weight`` too still gets its versions prepared.
The commit's blocking time is printed next to the reload path's, not asserted (2
shared cores).
"""

from __future__ import annotations

import time

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
from .storage import assert_same_storage, callable_rpcs, storages

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
N = 8


def _run_versions(llm, kind, directory, versions, prepare, *, deferred=None, **options):
    """Commit each (version, seed or weights), check the oracle; the commits' pauses.

    ``weights`` may be ``(published, oracle)``: a partial version and the model it makes.
    ``deferred``: a check of each commit's ``deferred_layers`` (layers past the prepare
    budget, written from staging at the commit).
    """
    llm.collective_rpc(
        "start_weight_subscriber",
        args=(str(directory),),
        kwargs={"subscriber_cls": FAKE_SUB, "prepare": prepare, **options},
    )
    seconds = []
    for version, seed in versions:
        if isinstance(seed, tuple):
            sent, w = seed
        else:
            sent = w = seed if isinstance(seed, dict) else new_weights(kind, seed)
        publish_to_dir(directory, version, sent)
        status = wait_until_applied(llm, version, timeout=30)
        for s in status:
            last = s["commits"][-1]
            assert last["version"] == version
            assert last["prepared"] is prepare, s
            assert s["last_error"] is None, s
            if deferred is not None:
                assert deferred(last["deferred_layers"]), last
            seconds.append(last["seconds"])
        assert_matches_hf(llm, kind, w, N)
    llm.collective_rpc("stop_weight_subscriber")
    return seconds


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = save_tiny("llama", 0, tmp_path_factory.mktemp("llama_prep"))
    with callable_rpcs():
        engine = make_llm(path, tp=1)
        yield engine
        shut_down(engine)


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
    path = save_tiny(TIED_QWEN2, 0, tmp_path_factory.mktemp("qwen2_prep"))
    with callable_rpcs():
        engine = make_llm(path, tp=2)
        yield engine
        shut_down(engine)


TIED_QWEN2 = "qwen2_tied"


def _with_head(w):
    """What a trainer's ``state_dict()`` of a tied model holds: the head under its own name."""
    return {**w, "lm_head.weight": w["model.embed_tokens.weight"].clone()}


def test_prepared_commit_matches_hf_tp2(qwen2_tp2, tmp_path):
    """TP slicing, fused qkv (with bias) / gate_up shards, one KV head replicated on 2 ranks,
    the vocab-parallel embedding tied to the head (sent with and without ``lm_head``)."""
    before = storages(qwen2_tp2)
    w2 = new_weights(TIED_QWEN2, 42)
    swap_s = _run_versions(qwen2_tp2, TIED_QWEN2, tmp_path, [(1, 41), (2, (_with_head(w2), w2))],
                           True)
    assert_same_storage(before, storages(qwen2_tp2))
    print(f"\nTP=2 tied commit blocking time per rank: prepared {swap_s}")


def test_llama_subscriber_versions(llama, tmp_path):
    """The plain subscriber path on a tiny Llama with tied embeddings (GQA), default
    options: each version gives transformers' output (shares this module's engine: the
    checkpoint's own output is checked by the first test)."""
    llama.collective_rpc(
        "start_weight_subscriber", args=(str(tmp_path),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    for version, seed in ((1, 21), (2, 22)):
        w = new_weights("llama", seed)
        publish_to_dir(tmp_path, version, w)
        wait_until_applied(llama, version, timeout=20)
        assert_matches_hf(llama, "llama", w, N)
    llama.collective_rpc("stop_weight_subscriber")


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
                                 kwargs={"window_bytes": 256 << 10,
                                         "prepare_budget_bytes": 1 << 30})
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


#: the Llama tensors that in-place writes reach on the CPU backend (linear weights are
#: repacked there: reload or prepared only)
_NOT_LINEAR = ("embed_tokens.", "layernorm.", "model.norm.")


def test_commits_keep_every_storage_and_the_tied_head_is_prepared(llama, tmp_path):
    """Issue 19: prepared, reload and in-place commits write into the live storage (no
    parameter or buffer moves). Issue 22: a version that also sends the tied
    ``lm_head.weight`` is prepared (it used to fail: 'shares storage with another sent
    tensor') and the output is transformers' on the new weights."""
    before = storages(llama)
    pauses: dict[str, list[float]] = {}
    w1 = new_weights("llama", 61)
    for d in "pri":
        (tmp_path / d).mkdir()
    pauses["prepared (lm_head sent too)"] = _run_versions(
        llama, "llama", tmp_path / "p", [(1, (_with_head(w1), w1))], True, apply_mode="auto")
    assert_same_storage(before, storages(llama))
    w2 = new_weights("llama", 62)
    pauses["reload"] = _run_versions(llama, "llama", tmp_path / "r", [(2, w2)], False,
                                     apply_mode="auto")
    assert_same_storage(before, storages(llama))
    part = {k: v for k, v in new_weights("llama", 63).items() if any(s in k for s in _NOT_LINEAR)}
    pauses["in place"] = _run_versions(llama, "llama", tmp_path / "i",
                                       [(3, (part, {**w2, **part}))], False,
                                       apply_mode="in_place")
    assert_same_storage(before, storages(llama))
    llama.collective_rpc("start_weight_subscriber", args=(str(tmp_path / "i"),),
                         kwargs={"subscriber_cls": FAKE_SUB, "apply_mode": "auto"})
    llama.collective_rpc("stop_weight_subscriber")
    print(f"\ncommit blocking time (s): {pauses}")


def _budget(llm):
    return llm.collective_rpc("weight_status")[0]["prepare_budget"]


def test_a_prepare_budget_leaves_layers_to_the_commit(llama, tmp_path):
    """Issue 18.3: shadows only within ``prepare_budget_bytes``; the layers past it are
    written from the staged bytes at the commit, in the same pause (vLLM's reload into
    the live storage). Default: no shadows at all. Every case gives transformers' output
    and keeps every storage; the budget's bytes come back after each commit."""
    before = storages(llama)
    size = sum(t.numel() * t.element_size() for t in new_weights("llama", 0).values())
    pauses: dict[str, list[float]] = {}
    for d in "dhtn":
        (tmp_path / d).mkdir()
    pauses["default: no shadows"] = _run_versions(llama, "llama", tmp_path / "d", [(1, 71)],
                                                  False)
    # half the model: some layers prepared, the rest (and maybe the tied head's kernel
    # copy) written at the commit
    pauses["half the model in shadows"] = _run_versions(
        llama, "llama", tmp_path / "h", [(2, 72), (3, (_with_head(new_weights("llama", 73)),
                                                       new_weights("llama", 73)))],
        True, prepare_budget_bytes=size // 2, deferred=lambda n: n > 0)
    budget = _budget(llama)  # the shadows are retired (freed) on the preparer thread
    deadline = time.monotonic() + 10
    while budget["held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
        budget = _budget(llama)
    assert budget["limit_bytes"] == size // 2 and budget["held_bytes"] == 0, budget
    assert 0 < budget["peak_bytes"] <= size // 2 and budget["layers_deferred"] > 0, budget
    # a budget smaller than any layer: everything written at the commit, through the
    # prepared path (the embedding deferred, so the tied head is re-processed by the reload)
    pauses["1 KiB of shadows"] = _run_versions(llama, "llama", tmp_path / "t", [(4, 74)], True,
                                               prepare_budget_bytes=1024,
                                               deferred=lambda n: n > 0)
    pauses["unbounded"] = _run_versions(llama, "llama", tmp_path / "n", [(5, 75)], True,
                                        deferred=lambda n: n == 0)
    assert_same_storage(before, storages(llama))
    print(f"\ncommit blocking time (s) by prepare budget: {pauses}")
