"""Engine-core commit driver (``subscriber_ext.vllm_ext.commit``), real transport, real engines.

(a) after a commit a new request never reuses prefix-cache blocks of the old weights,
(b) outputs carry the weight version (``CompletionOutput.weight_versions``),
(c) TP=2 ranks commit the same version at the same step with no per-step collective,
(d) an idle engine commits on an event (a rank's slot write wakes it), not on a poll.
"""

from __future__ import annotations

import os
import time

import pytest

from .helpers import (
    assert_same,
    hf_greedy,
    make_llm,
    new_weights,
    save_tiny,
    shut_down,
    vllm_greedy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 8
#: longer than a KV block (16 on CPU), so it lands in the prefix cache
P = [(i * 37 + 5) % 500 + 1 for i in range(140)]


def _sp(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)


def _greedy(out) -> tuple[list, list]:
    o = out.outputs[0]
    toks = list(o.token_ids)
    return toks, [float(o.logprobs[i][t].logprob) for i, t in enumerate(toks)]


def _wait(cond, what: str, timeout: float = 30.0):
    deadline = time.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _staged(llm, version: int) -> list[dict]:
    """Staged on every rank and committable: a version prepared off the step path (the
    engine ran a step lately) is only offered to the engine once its preparation ends."""
    return _wait(
        lambda: (
            (s := llm.collective_rpc("weight_status"))
            and all(x["staged_version"] == version or x["applied_version"] == version for x in s)
            and not any((x.get("prepare") or {}).get("preparing") for x in s)
            and s
        ),
        f"version {version} staged",
    )


def _driver(llm) -> dict:
    return llm.llm_engine.engine_core.call_utility("weightpub_driver_status")


def _engine(tmp_path_factory, tp: int, **extra):
    from publisher import WeightPublisher

    path = save_tiny(KIND, 0, tmp_path_factory.mktemp(f"drv{tp}"))
    llm = make_llm(path, tp=tp, enable_prefix_caching=True, **extra)
    pub = WeightPublisher("tcp://127.0.0.1:0")
    st = llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
    assert all(s["driven"] for s in st), st
    return llm, pub


@pytest.fixture(scope="class")
def tp1(tmp_path_factory):
    old = os.environ.get("WEIGHTPUB_IDLE_POLL_S")
    os.environ["WEIGHTPUB_IDLE_POLL_S"] = "600"  # no backstop poll: only the wake-up event
    try:
        llm, pub = _engine(tmp_path_factory, 1)
    finally:
        if old is None:
            os.environ.pop("WEIGHTPUB_IDLE_POLL_S")
        else:
            os.environ["WEIGHTPUB_IDLE_POLL_S"] = old
    yield llm, pub
    llm.collective_rpc("stop_weight_subscriber")
    pub.close()
    shut_down(llm)


@pytest.fixture(scope="class")
def tp2(tmp_path_factory):
    old = os.environ.get("WEIGHTPUB_IDLE_POLL_S")
    os.environ["WEIGHTPUB_IDLE_POLL_S"] = "0"  # commit only at steps and our RPCs
    try:
        llm, pub = _engine(tmp_path_factory, 2)
    finally:
        if old is None:
            os.environ.pop("WEIGHTPUB_IDLE_POLL_S")
        else:
            os.environ["WEIGHTPUB_IDLE_POLL_S"] = old
    yield llm, pub
    llm.collective_rpc("stop_weight_subscriber")
    pub.close()
    shut_down(llm)


class TestTP1:
    def test_busy_commit_no_stale_prefix(self, tp1):
        llm, pub = tp1
        assert _driver(llm)["active"]
        first = llm.generate([{"prompt_token_ids": P}], _sp(1), use_tqdm=False)[0]
        again = llm.generate([{"prompt_token_ids": [*P, 9]}], _sp(1), use_tqdm=False)[0]
        assert again.num_cached_tokens > 0, "prefix caching is not on"
        assert first.outputs[0].weight_versions[0].version == "default"

        engine = llm.llm_engine
        engine.add_request("A", {"prompt_token_ids": [1, 2, 3, 4]}, _sp(250))
        outs: dict[str, object] = {}

        def pump() -> None:
            for o in engine.step():
                outs[o.request_id] = o

        _wait(lambda: (pump(), "A" in outs)[1], "A running")
        w = new_weights(KIND, 41)
        v = pub.publish(w)
        _wait(
            lambda: all(s["applied_version"] == v for s in llm.collective_rpc("weight_status")),
            f"version {v} committed while A runs",
        )
        prompt_b = [*P, 11, 12, 13]
        engine.add_request("B", {"prompt_token_ids": prompt_b}, _sp(N))
        while engine.has_unfinished_requests():
            pump()
        a, b = outs["A"], outs["B"]
        spans = a.outputs[0].weight_versions
        assert [s.version for s in spans] == ["default", str(v)], spans  # (b) mid-request switch
        assert spans[0].start == 0 and spans[-1].end == 250
        assert [(s.version, s.start, s.end) for s in b.outputs[0].weight_versions] == [
            (str(v), 0, N)
        ]
        assert_same([_greedy(b)], hf_greedy(KIND, w, N, prompts=[prompt_b]))
        assert b.num_cached_tokens == 0, b.num_cached_tokens
        commit = _driver(llm)["commits"][-1]
        print(f"busy commit: {commit}")
        assert commit["version"] == v and commit["prefix"] == "evicted", commit

    def test_idle_engine_commits(self, tp1):
        llm, pub = tp1
        prompt = [*P, 21, 22]
        llm.generate([{"prompt_token_ids": prompt}], _sp(N), use_tqdm=False)  # cache it
        w = new_weights(KIND, 42)
        # read before publishing: read after, it raced the commit (CI1 of session 15 saw
        # the wake counted already, 4 > 4)
        wakes = _driver(llm)["idle_wakes"]
        v = pub.publish(w)
        # no request, no RPC (each would wake the engine), no poll (600 s backstop): the
        # rank's slot write wakes the engine from its input wait and it commits; we watch
        # from outside, through the replica's report to the publisher
        pub.wait_for_subscribers(v, count=1, applied=True, timeout=30)
        assert llm.llm_engine.get_weight_version() == str(v)
        assert _driver(llm)["idle_wakes"] > wakes
        states = llm.collective_rpc("weight_version")
        assert all(s["applied_version"] == v and s["collectives"] == 0 for s in states), states
        commit = _driver(llm)["commits"][-1]
        assert commit["prefix"] == "reset", commit
        out = llm.generate([{"prompt_token_ids": prompt}], _sp(N), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].weight_versions[0].version == str(v)
        assert_same([_greedy(out)], hf_greedy(KIND, w, N, prompts=[prompt]))
        d = _driver(llm)
        print(f"TP=1 engine check: {d['check_s'] / max(d['checks'], 1) * 1e6:.2f} us/step")


class TestTP2:
    def test_tp2_same_step_no_collective(self, tp2):
        llm, pub = tp2
        before = llm.collective_rpc("weight_status")
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], _sp(64), use_tqdm=False)
        after = llm.collective_rpc("weight_status")
        for b, a in zip(before, after, strict=True):
            steps = a["step"] - b["step"]
            per_step = (a["step_check_s"] - b["step_check_s"]) / max(steps, 1)
            print(f"TP=2 driven rank {a['rank']}: {steps} steps, {per_step * 1e6:.1f} us/step")
            assert steps >= 64 and a["collectives"] == 0
        w = new_weights(KIND, 43)
        v = pub.publish(w)
        _staged(llm, v)
        assert llm.llm_engine.get_weight_version() == "default"  # idle poll is off
        out = llm.generate([{"prompt_token_ids": [*P, 5]}], _sp(N), use_tqdm=False)[0]
        assert [s.version for s in out.outputs[0].weight_versions] == [str(v)]
        states = llm.collective_rpc("weight_status")
        logs = [[(c["step"], c["version"]) for c in s["commits"]] for s in states]
        assert logs[0] == logs[1] and logs[0][-1][1] == v, logs
        assert all(s["collectives"] == 0 for s in states), states
        assert_same([_greedy(out)], hf_greedy(KIND, w, N, prompts=[[*P, 5]]))

    def test_tp2_idle_rpc_commits(self, tp2):
        llm, pub = tp2
        w = new_weights(KIND, 44)
        v = pub.publish(w)
        _staged(llm, v)
        states = llm.collective_rpc("weight_version")  # commits before it is forwarded
        assert all(s["applied_version"] == v for s in states), states
        assert llm.llm_engine.get_weight_version() == str(v)
        assert_same(vllm_greedy(llm, N), hf_greedy(KIND, w, N))
        d = _driver(llm)
        print(f"TP=2 engine check: {d['check_s'] / max(d['checks'], 1) * 1e6:.2f} us/step")
