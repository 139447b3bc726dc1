"""TP=2 tiny Qwen2 (1 KV head over 2 ranks: GQA replication): all paths match transformers."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from .helpers import (
    FAKE_SUB,
    assert_matches_hf,
    encode_all,
    free_port,
    make_llm,
    new_weights,
    publish_to_dir,
    save_tiny,
    trainer_main,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny(KIND, 0, tmp_path_factory.mktemp("qwen2tp2"))
    engine = make_llm(path, tp=2)
    yield engine
    del engine


def _check(llm, weights):
    assert_matches_hf(llm, KIND, weights, N)


def test_tp2_http_batch(llm):
    _check(llm, new_weights(KIND, 0))
    w = new_weights(KIND, 31)
    llm.collective_rpc("http_load_weights_batch", args=(encode_all(w),))
    _check(llm, w)


def test_tp2_subscriber_ranks_agree(llm, tmp_path):
    from vllm import SamplingParams

    llm.collective_rpc(
        "start_weight_subscriber", args=(str(tmp_path),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    # idle per-step cost of the agreement collective (nothing staged)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    before = llm.collective_rpc("weight_version")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    after = llm.collective_rpc("weight_version")
    for b, a in zip(before, after, strict=True):
        steps = a["step"] - b["step"]
        per_step = (a["step_check_s"] - b["step_check_s"]) / max(steps, 1)
        print(f"rank {a['rank']}: {steps} steps, commit check {per_step * 1e6:.1f} us/step")
    w = new_weights(KIND, 32)
    publish_to_dir(tmp_path, 1, w)
    deadline = time.time() + 20
    while True:
        states = llm.collective_rpc("weight_version")
        if all(s["applied_version"] == 1 for s in states):
            break
        assert time.time() < deadline, states
        time.sleep(0.05)
    assert len({tuple((c["step"], c["version"]) for c in s["commits"]) for s in states}) == 1
    llm.collective_rpc("stop_weight_subscriber")
    _check(llm, w)


def test_tp2_seed_gloo(llm, tmp_path):
    from safetensors.torch import save_file

    w = new_weights(KIND, 33)
    path = tmp_path / "w.safetensors"
    save_file(w, str(path))
    port = free_port()
    trainer = mp.get_context("spawn").Process(
        target=trainer_main, args=("127.0.0.1", port, 2, str(path), 1)
    )
    trainer.start()
    try:
        llm.collective_rpc("init_communicator", args=("127.0.0.1", port, 3, None))
        specs = [(n, str(t.dtype), list(t.shape)) for n, t in sorted(w.items())]
        llm.collective_rpc("batch_update_named_params", args=(specs,))
        llm.collective_rpc("close_communicator")
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
    _check(llm, w)
