"""TP=1 tiny Qwen2: every apply path gives transformers' output on the new weights."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from subscriber_ext import wait_until_applied

from .helpers import (
    FAKE_SUB,
    PROMPTS,
    assert_matches_hf,
    children,
    encode_all,
    free_port,
    hf_greedy,
    new_weights,
    publish_to_dir,
    trainer_main,
    vllm_greedy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 8


@pytest.fixture(scope="module")
def llm(qwen2_tp1_engine):
    """Fresh here (the first module to use it); test_transport_e2e.py goes on with it."""
    return qwen2_tp1_engine


def _check(llm, weights):
    assert_matches_hf(llm, KIND, weights, N)


def test_initial_matches_hf(llm):
    _check(llm, new_weights(KIND, 0))


def test_http_batch_applies_new_weights(llm):
    w = new_weights(KIND, 11)
    assert hf_greedy(KIND, w, N) != hf_greedy(KIND, new_weights(KIND, 0), N)
    t0 = time.perf_counter()
    llm.collective_rpc("http_load_weights_batch", args=(encode_all(w),))
    print(f"http_load_weights_batch: {time.perf_counter() - t0:.3f}s")
    _check(llm, w)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (
            lambda w: w.__setitem__("model.layers.0.self_attn.nope.weight", torch.zeros(2)),
            "model.layers.0.self_attn.nope.weight",
        ),
        (
            lambda w: w.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(256, 64)),
            "model.layers.1.mlp.up_proj.weight",
        ),
        (
            lambda w: w.__setitem__(
                "model.layers.0.self_attn.k_proj.weight",
                w["model.layers.0.self_attn.k_proj.weight"].bfloat16(),
            ),
            "model.layers.0.self_attn.k_proj.weight",
        ),
    ],
    ids=["wrong_name", "wrong_shape", "wrong_dtype"],
)
def test_bad_tensor_rejected_weights_unchanged(llm, mutate, needle):
    before = vllm_greedy(llm, N)
    w = new_weights(KIND, 12)
    mutate(w)
    with pytest.raises(Exception, match=needle.replace(".", r"\.")):
        llm.collective_rpc("http_load_weights_batch", args=(encode_all(w),))
    llm.reset_prefix_cache()
    assert vllm_greedy(llm, N) == before


def test_subscriber_commit_and_version(llm, tmp_path):
    w = new_weights(KIND, 13)
    st = llm.collective_rpc(
        "start_weight_subscriber", args=(str(tmp_path),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    assert st[0]["applied_version"] is None
    publish_to_dir(tmp_path, 1, w)
    v = wait_until_applied(llm, 1, timeout=20)[0]
    assert v["applied_version"] == 1 and v["last_error"] is None, v
    print(f"commit v1: mode={v['apply_mode']} apply={v['last_apply_s']:.3f}s")
    _check(llm, w)


def test_commit_while_generating(llm, tmp_path):
    """Versions stream in during generation: every request completes, commits are logged."""
    from vllm import SamplingParams

    d = tmp_path / "stream"
    d.mkdir()
    llm.collective_rpc(
        "start_weight_subscriber", args=(str(d),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    b = llm.collective_rpc("weight_version")[0]
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(max_tokens=64, ignore_eos=True),
        use_tqdm=False,
    )
    a = llm.collective_rpc("weight_version")[0]
    idle = (a["step_check_s"] - b["step_check_s"]) / max(a["step"] - b["step"], 1)
    print(f"TP=1 idle commit check: {idle * 1e6:.1f} us/step")
    versions = {v: new_weights(KIND, 100 + v) for v in range(1, 5)}
    done = threading.Event()

    def publish():
        v = 0
        while not done.is_set() and v < 40:
            v += 1
            publish_to_dir(d, v, versions[(v - 1) % 4 + 1])
            done.wait(0.05)

    t = threading.Thread(target=publish)
    t.start()
    sp = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i % 500 + 1, 7, 9]} for i in range(16)]
    try:
        out = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        done.set()
        t.join()
    assert all(len(o.outputs[0].token_ids) == 160 for o in out)
    status = llm.collective_rpc("weight_version")[0]
    assert status["last_error"] is None, status
    reqs = llm.collective_rpc("weight_request_versions")[0]
    print("commits:", len(status["commits"]), "steps:", status["step"])
    assert len(status["commits"]) >= 2, status["commits"]
    # the engine may suffix request ids internally ("27" -> "27-<random>")
    spans = [
        next(v for k, v in reqs.items() if k == o.request_id or k.startswith(o.request_id + "-"))
        for o in out
    ]
    assert any(first != last for first, last in spans), spans  # versions moved mid-request
    # the final version is live and correct
    publish_to_dir(d, 99, versions[4])
    wait_until_applied(llm, 99, timeout=20)
    llm.collective_rpc("stop_weight_subscriber")
    _check(llm, versions[4])


def test_seed_gloo_broadcast(llm, tmp_path):
    from safetensors.torch import save_file

    w = new_weights(KIND, 14)
    path = tmp_path / "w.safetensors"
    save_file(w, str(path))
    port = free_port()
    trainer = children().Process(target=trainer_main, args=("127.0.0.1", port, 1, str(path), 2))
    trainer.start()
    try:
        llm.collective_rpc("init_communicator", args=("127.0.0.1", port, 2, None))
        for name, t in sorted(w.items()):  # round 1: one RPC per tensor
            llm.collective_rpc("update_named_param", args=(name, str(t.dtype), list(t.shape)))
        _check(llm, w)
        llm.collective_rpc("http_load_weights_batch", args=(encode_all(new_weights(KIND, 0)),))
        specs = [(n, str(t.dtype), list(t.shape)) for n, t in sorted(w.items())]
        llm.collective_rpc("batch_update_named_params", args=(specs,))  # round 2
        _check(llm, w)
        llm.collective_rpc("close_communicator")
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
    assert len(PROMPTS) == 3
