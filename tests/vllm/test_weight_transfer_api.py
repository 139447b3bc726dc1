"""vLLM's own weight-transfer API switched to ``"weightpub"``: vLLM's RLHF loop, unchanged.

The replica is an ``LLM`` with ``weight_transfer_config={"backend": "weightpub"}`` and
nothing else of ours (no ``worker_extension_cls``); the trainer uses only vLLM's
trainer API (``WeightTransferTrainerFactory.trainer_init`` with a ``ModuleSource``,
``send_weights``). The oracle is transformers on the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .helpers import assert_matches_hf, build_hf, new_weights, save_tiny, shut_down

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6
REPO = Path(__file__).resolve().parents[2]


def test_an_engine_without_weightpub_options_runs_untouched(tmp_path_factory) -> None:
    """A fresh process (no earlier engine decides for it): plugin loaded, nothing patched."""
    path = save_tiny(KIND, 0, tmp_path_factory.mktemp("plain"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WEIGHTPUB_VLLM_PATCHES", None)
    run = subprocess.run([sys.executable, "-m", "tests.vllm.plugin_probe", str(path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    seen = json.loads(lines[-1])
    front, workers = seen["front"], seen["workers"]
    assert front["backend_registered"]  # the plugin did run here
    assert not any(front[k] for k in ("engine_core", "worker_init", "slot_table",
                                      "replica_metrics")), front
    for w in workers:
        assert not any(w[k] for k in ("engine_core", "worker_init", "slot_table", "extension")), w
        assert w["weight_transfer_engine"] == "NoneType"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightpub.vllm_trainer import LLMClient, WeightpubTrainerInitInfo

    path = save_tiny(KIND, 0, tmp_path_factory.mktemp("wt"))
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
              max_num_seqs=16, gpu_memory_utilization=0.2, max_model_len=256,
              weight_transfer_config={"backend": "weightpub"})
    model = build_hf(KIND, 0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightpubTrainerInitInfo(rank=0, wait_replicas=1, timeout=60.0),
        client=LLMClient(llm), source=ModuleSource(model))
    yield SimpleNamespace(llm=llm, model=model, trainer=trainer, path=path, last_weights=None)
    trainer.shutdown()
    shut_down(llm)


def _labels(llm) -> list[str]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": [5, 17, 42]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    return [span.version for span in out[0].outputs[0].weight_versions]


def test_the_rlhf_loop_runs_three_versions_checked_by_the_oracle(rig) -> None:
    import torch

    ranks = rig.llm.collective_rpc("weight_status")  # the backend mixed our extension in
    assert all(r["endpoint"] == rig.trainer.replica_endpoint for r in ranks), ranks
    for version, seed in enumerate((11, 12, 13), start=1):
        weights = new_weights(KIND, seed)
        with torch.no_grad():
            rig.model.load_state_dict(weights)
        rig.trainer.send_weights()  # publish, wait for the replica, start/update/finish
        assert rig.trainer.last_version == version
        assert [r["applied_version"] for r in rig.llm.collective_rpc("weight_status")] \
            == [version]
        assert rig.llm.get_weight_version() == str(version)
        assert _labels(rig.llm) == [str(version)]  # outputs carry the committed version
        assert_matches_hf(rig.llm, KIND, weights, N)
    rig.last_weights = weights


def test_the_label_stays_the_committed_version(rig) -> None:
    before = rig.llm.get_weight_version()
    rig.llm.start_weight_update()
    rig.llm.finish_weight_update(weight_version="made-up")
    assert rig.llm.get_weight_version() == before
    assert _labels(rig.llm) == [before]


def test_update_weights_names_what_each_rank_runs_when_the_version_never_comes(rig) -> None:
    applied = int(rig.llm.get_weight_version())
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match=rf"runs version {applied} .*not >= 999 after 1s"):
        rig.llm.update_weights({"update_info": {"version": 999, "timeout": 1.0}})
    rig.llm.start_weight_update()  # the failed update ended the session; a new one starts
    rig.llm.finish_weight_update()
    assert rig.llm.get_weight_version() == str(applied)


def test_a_late_subscriber_on_the_same_endpoint_gets_the_newest_version(rig) -> None:
    """Fan-out and late join: the trainer's endpoint serves whoever comes, when it comes."""
    from subscriber_ext import WeightSubscriber

    got: list[int] = []
    arrived = threading.Event()

    def on_version(staged) -> None:
        got.append(staged.version)
        staged.release()
        arrived.set()

    sub = WeightSubscriber(rig.trainer.replica_endpoint, on_version=on_version)
    try:
        assert arrived.wait(60), "the late subscriber got nothing"
    finally:
        sub.close()
    assert got[0] == rig.trainer.last_version


def test_a_late_replica_given_the_endpoint_in_additional_config(rig) -> None:
    """A second replica started after the loop: the endpoint comes from
    ``--additional-config`` (no init call), and vLLM's update_weights brings it to the
    newest version, checked by the oracle. It then follows the trainer's next version."""
    import torch
    from vllm import LLM

    assert rig.last_weights is not None, "runs after the RLHF loop"
    newest = rig.trainer.last_version
    late = LLM(model=str(rig.path), dtype="float32", skip_tokenizer_init=True,
               enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.2,
               max_model_len=256, weight_transfer_config={"backend": "weightpub"},
               additional_config={"weightpub": {"endpoint": rig.trainer.replica_endpoint}})
    try:
        late.start_weight_update()
        late.update_weights({"update_info": {"version": newest, "timeout": 60.0}})
        late.finish_weight_update()
        assert late.get_weight_version() == str(newest)
        assert_matches_hf(late, KIND, rig.last_weights, N)
        weights = new_weights(KIND, 14)
        with torch.no_grad():
            rig.model.load_state_dict(weights)
        rig.trainer.info.wait_replicas = 2  # both replicas report it applied
        try:
            rig.trainer.send_weights()
        finally:
            rig.trainer.info.wait_replicas = 1
        late.start_weight_update()
        late.update_weights({"update_info": {"version": newest + 1, "timeout": 60.0}})
        late.finish_weight_update()
        for replica in (rig.llm, late):
            assert replica.get_weight_version() == str(newest + 1)
            assert_matches_hf(replica, KIND, weights, N)
    finally:
        shut_down(late)


def test_in_flight_requests_complete_across_a_commit_with_their_version_spans(rig) -> None:
    """A trainer's ``send_weights`` lands while requests generate (no pause, no abort).

    Requests of staggered lengths are kept in flight (one replaced as it finishes), so
    a commit between any two steps falls inside some request. Every request completes
    in full; its ``weight_versions`` spans cover its tokens contiguously, old version
    first; a request running at the commit spans both; one added after the replica
    reported the version applied carries only the new one.
    """
    import torch
    from vllm import SamplingParams

    from subscriber_ext.staleness import parse_version_label, version_range

    engine = rig.llm.llm_engine
    old = parse_version_label(rig.llm.get_weight_version())
    lengths = (120, 150, 180, 210)  # staggered: the requests never all finish at once
    outs: dict[str, object] = {}
    wanted: dict[str, int] = {}
    sent = threading.Event()
    failure: list[BaseException] = []

    def add(tag: str, i: int) -> None:
        rid = f"{tag}{i}"
        wanted[rid] = lengths[i % len(lengths)]
        engine.add_request(rid, {"prompt_token_ids": [3 + i % 50, 17, 42]},
                           SamplingParams(temperature=0.0, max_tokens=wanted[rid],
                                          ignore_eos=True))

    def pump() -> None:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o

    def send(weights) -> None:
        try:
            with torch.no_grad():
                rig.model.load_state_dict(weights)
            rig.trainer.send_weights()  # returns once the replica reports it applied
        except BaseException as exc:  # re-raised in the test's thread
            failure.append(exc)
        finally:
            sent.set()

    def refill() -> None:  # keep len(lengths) requests in flight
        for _ in range(len(wanted) - len(outs), len(lengths)):
            add("run", len(wanted))

    refill()
    while len(outs) < 2:  # the stream is under way: requests finish and are replaced
        pump()
        refill()
    weights = new_weights(KIND, 15)
    client, rig.trainer.client = rig.trainer.client, None  # LLM is driven from this thread
    sender = threading.Thread(target=send, args=(weights,), name="test-send-weights")
    sender.start()
    deadline = time.monotonic() + 60
    try:
        while not sent.is_set():
            assert time.monotonic() < deadline, "send_weights did not return within 60 s"
            pump()
            refill()
    finally:
        sender.join(60)
        rig.trainer.client = client
    assert not failure, failure
    new = rig.trainer.last_version
    assert new == old + 1
    for i in range(2):
        add("after", i)
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline + 30, "requests did not finish"
        pump()

    assert sorted(outs) == sorted(wanted)  # none lost
    spanning = []
    for rid, out in outs.items():
        comp = out.outputs[0]  # type: ignore[attr-defined]
        assert comp.finish_reason == "length" and len(comp.token_ids) == wanted[rid], rid
        spans = comp.weight_versions
        assert spans and spans[0].start == 0 and spans[-1].end == wanted[rid], (rid, spans)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False)), (rid, spans)
        versions = [parse_version_label(s.version) for s in spans]
        assert versions in ([old], [new], [old, new]), (rid, spans)
        if rid.startswith("after"):
            assert versions == [new], (rid, spans)
        if versions == [old, new]:
            assert version_range(spans).mixed
            spanning.append(rid)
    assert spanning, {rid: o.outputs[0].weight_versions for rid, o in outs.items()}  # type: ignore[attr-defined]
    print(f"{len(outs)} requests, {len(spanning)} across the commit {old} -> {new}")
    # vLLM's control plane agrees, and the replica runs the new weights
    client.start_weight_update()
    client.update_weights({"version": new, "timeout": 60.0})
    client.finish_weight_update()
    assert rig.llm.get_weight_version() == str(new)
    assert_matches_hf(rig.llm, KIND, weights, N)
    rig.last_weights = weights


def test_init_info_options_are_checked_and_never_name_code_to_import(rig) -> None:
    """``init_weight_transfer_engine`` is reachable by any client of the server: each option
    is checked by its declaration in every worker (the same error as the keyword), and
    ``subscriber_cls``, which names code to import, is refused before any import. The
    replica keeps following its publisher."""
    endpoint = rig.trainer.replica_endpoint
    before = rig.llm.get_weight_version()
    for options, error in (
            ({"subscriber_cls": "os:system"}, "subscriber_cls: Python only"),
            ({"chunks_per_request": 0}, "chunks_per_request: Input should be greater than"),
            ({"request_timeout": -1}, "request_timeout: Input should be greater than 0"),
            ({"window_mib": 8}, "unknown option")):
        with pytest.raises(Exception, match=error):
            rig.llm.init_weight_transfer_engine(
                {"init_info": {"endpoint": endpoint, "options": options}})
    assert rig.llm.get_weight_version() == before
    assert _labels(rig.llm) == [before]  # still generating, on the version it ran


def _within(seconds: float, what: str, call):
    """``call()``'s result, run on a thread of its own: a wedged engine fails the test
    (naming ``what``) instead of hanging it."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"test-{what}")
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what}: no answer within {seconds:g} s (engine wedged?)"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


def test_update_weights_for_an_unpublished_version_never_stops_the_engine(rig) -> None:
    """Issue 28 item 4: ``update_weights`` for a version nobody published yet waits beside
    the engine's step loop (``commit/update_waits.py``): meanwhile a generate call finishes,
    status RPCs answer and the replica keeps its version; the call returns once the
    version is published and live. A timeout past the bound is refused at once, and a
    short one raises the named error about when it ends."""
    import torch
    from vllm import SamplingParams

    from subscriber_ext.staleness import parse_version_label

    llm = rig.llm
    client = llm.llm_engine.engine_core
    send, lock = client._send_input, threading.Lock()

    def send_locked(*args, **kwargs):  # two threads share the client's socket below
        with lock:
            return send(*args, **kwargs)

    client._send_input = send_locked
    applied = parse_version_label(llm.get_weight_version())
    target = applied + 1
    outcome: dict[str, object] = {}

    def update() -> None:
        try:
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": target, "timeout": 600.0}})
            outcome["returned_at"] = time.monotonic()
            llm.finish_weight_update()
        except BaseException as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=update, daemon=True, name="test-update-weights")
    t0 = time.monotonic()
    waiter.start()
    weights = new_weights(KIND, 16)
    try:
        deadline = time.monotonic() + 20
        while _within(20, "driver status", lambda: client.call_utility(
                "weightpub_driver_status")).get("update_waits") != 1:
            assert time.monotonic() < deadline, "update_weights never reached the engine"
            time.sleep(0.05)
        t1 = time.monotonic()
        outs = _within(30, "generate", lambda: llm.generate(
            [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": [7, 8]}],
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False))
        generate_s = time.monotonic() - t1
        assert [len(o.outputs[0].token_ids) for o in outs] == [40, 40]
        ranks = _within(10, "status RPC", lambda: llm.collective_rpc("weight_status"))
        assert [r["applied_version"] for r in ranks] == [applied or None], ranks
        assert waiter.is_alive() and not outcome, outcome  # still waiting: nothing published
    finally:
        published_at = time.monotonic()
        with torch.no_grad():
            rig.model.load_state_dict(weights)
        trainer_client, rig.trainer.client = rig.trainer.client, None  # publish only: the
        try:  # update session is the waiting thread's
            rig.trainer.send_weights()  # publish the version the call waits for
        finally:
            rig.trainer.client = trainer_client
        waiter.join(60)
        client._send_input = send
    assert "returned_at" in outcome, outcome
    assert rig.trainer.last_version == target
    assert llm.get_weight_version() == str(target)
    assert_matches_hf(llm, KIND, weights, N)
    rig.last_weights = weights
    print(f"generate while waiting: {generate_s:.2f} s; update_weights waited "
          f"{published_at - t0:.1f} s, returned {outcome['returned_at'] - published_at:.2f} s "
          "after the publish began")

    t0 = time.monotonic()  # past the bound: refused before anything waits
    llm.start_weight_update()
    with pytest.raises(Exception,
                       match=r"update_info\.timeout: 1000000000\.0 is outside \(0, 86400\]"):
        llm.update_weights({"update_info": {"version": target + 1, "timeout": 1e9}})
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()  # a short wait ends with the named error on time
    llm.start_weight_update()
    with pytest.raises(Exception, match=rf"runs version {target} .*not >= {target + 9} after 2s"):
        llm.update_weights({"update_info": {"version": target + 9, "timeout": 2.0}})
    assert 2.0 <= time.monotonic() - t0 < 10
