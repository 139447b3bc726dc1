"""TP=2 tiny Qwen2 (1 KV head over 2 ranks: GQA replication): all paths match transformers.

This engine runs *without* the engine-core driver: the ranks agree on each commit
among themselves (``RankAgreement``, an all_gather on the TP CPU group before every
step), the path a deployment takes without our vLLM plugin. The driven path at TP=2
is ``test_engine_driver.py``; both are checked against the same oracle.
"""

from __future__ import annotations

import time

import pytest

from subscriber_ext import wait_until_applied

from .helpers import (
    FAKE_SUB,
    assert_matches_hf,
    children,
    encode_all,
    free_port,
    make_llm,
    new_weights,
    publish_to_dir,
    save_tiny,
    trainer_main,
    trainer_packed_main,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny(KIND, 0, tmp_path_factory.mktemp("qwen2tp2"))
    engine = make_llm(path, tp=2, engine_driver=False)
    yield engine
    del engine


def _check(llm, weights):
    assert_matches_hf(llm, KIND, weights, N)


def _wait_applied(llm, version, publisher_id):
    """``wait_until_applied`` printing every rank's full ``weight_status`` when it fails
    (the timeout message alone, cut off in a CI log, left a failure undiagnosable)."""
    import json

    try:
        return wait_until_applied(llm, version, publisher_id=publisher_id, fail_on_error=True)
    except Exception:
        for state in llm.collective_rpc("weight_status"):
            print(f"rank {state.get('rank')} weight_status:\n"
                  f"{json.dumps(state, indent=1, default=str)}")
        raise


def test_tp2_http_batch(llm):
    _check(llm, new_weights(KIND, 0))
    w = new_weights(KIND, 31)
    llm.collective_rpc("http_load_weights_batch", args=(encode_all(w),))
    _check(llm, w)


def test_tp2_ranks_agree_on_three_versions_over_the_transport(llm):
    from vllm import SamplingParams

    from publisher import WeightPublisher

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        states = llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        assert not any(s["driven"] for s in states), "this engine must run without the driver"
        try:
            # idle per-step cost of the agreement collective (nothing staged)
            sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            before = llm.collective_rpc("weight_status")
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
            after = llm.collective_rpc("weight_status")
            for b, a in zip(before, after, strict=True):
                steps = a["step"] - b["step"]
                per_step = (a["step_check_s"] - b["step_check_s"]) / max(steps, 1)
                print(f"rank {a['rank']}: {steps} steps, agreement {per_step * 1e6:.1f} us/step")
                assert steps >= 64 and a["collectives"] > b["collectives"]
            for seed in (32, 34, 35):
                w = new_weights(KIND, seed)
                version = pub.publish(w)
                states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                            fail_on_error=True)
                logs = [[(c["step"], c["version"]) for c in s["commits"]] for s in states]
                assert logs[0] == logs[1], logs  # same version before the same step
                _check(llm, w)
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_tp2_trainer_ranks_publish_their_shards_then_the_job_restarts_with_four(llm, tmp_path):
    """Issue 20: two trainer processes each publish their share (``ShardedPublisher``);
    the replica stages the union (fetching each chunk from its rank) and matches
    transformers after each version. Then the job restarts with four ranks (an elastic
    resize: a new coordinator instance on the same announce endpoint, versions going on,
    two more rank processes): the replica follows the new instance and matches again,
    each rank serving about a quarter of the model."""
    from safetensors.torch import save_file

    from .shard_trainer import shard_trainer_main

    ctx = children()
    out = ctx.Queue()
    commands = [ctx.Queue() for _ in range(4)]
    ranks: list = []

    def spawn(rank, world, coordinator):
        ranks.append(ctx.Process(target=shard_trainer_main,
                                 args=(rank, world, coordinator, commands[rank], out)))
        ranks[-1].start()

    def ready(count):  # rank 0's (announce, collect, publisher_id) when it is among them
        got = sorted((out.get(timeout=120) for _ in range(count)), key=lambda m: m[1])
        assert all(m[0] == "ready" for m in got), got
        return got[0][2:]

    def publish(version, seed, world):  # the weights, each rank's shard bytes
        w = new_weights(KIND, seed)
        path = tmp_path / f"w{version}.safetensors"
        save_file(w, str(path))
        for queue in commands[:world]:
            queue.put(("publish", str(path), version))
        got = sorted(out.get(timeout=120) for _ in range(world))
        assert [m[:3] for m in got] == [("published", r, version) for r in range(world)], got
        return w, [m[3] for m in got]

    started = False
    try:
        spawn(0, 2, "tcp://127.0.0.1:0")
        announce, collect, publisher_id = ready(1)
        spawn(1, 2, collect)
        ready(1)
        llm.collective_rpc("start_weight_subscriber", args=(announce,))
        started = True
        for version, seed in ((1, 40), (2, 41)):
            w, _ = publish(version, seed, 2)
            _wait_applied(llm, version, publisher_id)
            _check(llm, w)

        # the job restarts with 4 ranks: rank 0 announces where the old coordinator did
        began = time.monotonic()
        commands[0].put(("restart", 0, 4, "tcp://127.0.0.1:0", announce))
        again, collect, resized = ready(1)
        assert again == announce and resized != publisher_id
        commands[1].put(("restart", 1, 4, collect, None))
        spawn(2, 4, collect)
        spawn(3, 4, collect)
        ready(3)
        w, shards = publish(3, 42, 4)
        _wait_applied(llm, 3, resized)
        _check(llm, w)
        print(f"4-rank restart followed in {time.monotonic() - began:.1f} s; shards "
              f"{[round(s / sum(shards), 3) for s in shards]} of {sum(shards)} bytes")
        assert all(0.2 < s / sum(shards) < 0.3 for s in shards), shards
    finally:
        if started:
            llm.collective_rpc("stop_weight_subscriber")
        for queue in commands:
            queue.put(("exit",))
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [p.exitcode for p in ranks] == [0, 0, 0, 0]


def test_tp2_directory_source_is_a_version_source(llm, tmp_path):
    """A stand-in source (no transport) plugs in through ``subscriber_cls``; commits are
    reported back through its ``mark_applied``."""
    llm.collective_rpc(
        "start_weight_subscriber", args=(str(tmp_path),), kwargs={"subscriber_cls": FAKE_SUB}
    )
    try:
        w = new_weights(KIND, 36)
        publish_to_dir(tmp_path, 1, w)
        states = wait_until_applied(llm, 1, publisher_id=f"dir:{tmp_path}", timeout=30)
        assert all([1, None] in map(list, s["subscriber"]["marked"]) for s in states), states
        _check(llm, w)
    finally:
        llm.collective_rpc("stop_weight_subscriber")


def test_tp2_seed_gloo(llm, tmp_path):
    from safetensors.torch import save_file

    w = new_weights(KIND, 33)
    path = tmp_path / "w.safetensors"
    save_file(w, str(path))
    port = free_port()
    trainer = children().Process(
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


def test_tp2_seed_gloo_packed_buckets_and_a_stale_communicator_closed_first(llm, tmp_path):
    """The trainer sends a whole list in packed buckets (a marker spec first, same RPC
    signature); a second ``init_communicator`` without ``close_communicator`` closes the
    stale group first and the next session works."""
    from safetensors.torch import save_file

    from subscriber_ext.vllm_ext.seed.broadcast_client import BroadcastClient

    w = new_weights(KIND, 37)
    path = tmp_path / "w.safetensors"
    save_file(w, str(path))
    ports = [free_port(), free_port()]
    ctx = children()
    counts = ctx.Queue()
    trainer = ctx.Process(target=trainer_packed_main,
                          args=("127.0.0.1", ports, 2, str(path), counts))
    trainer.start()
    try:
        specs = BroadcastClient.packed_specs(sorted(w.items()))
        for port in ports:  # the second init finds the first group still open
            llm.collective_rpc("init_communicator", args=("127.0.0.1", port, 3, None))
            llm.collective_rpc("batch_update_named_params", args=(specs,))
        llm.collective_rpc("close_communicator")
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
    broadcasts = [counts.get(timeout=5) for _ in ports]
    assert broadcasts == [1, 1], broadcasts  # one bucket for the model, not one per tensor
    assert len(w) > 10
    _check(llm, w)


def test_tp2_an_rpc_failing_on_every_rank_raises_once_and_later_replies_are_their_own(llm):
    """vLLM raises at the first failed reply and leaves the others queued
    (vllm-project/vllm#57846); our RPCs let only the last rank raise, for all ranks."""
    good = new_weights(KIND, 38)
    bad_name = "model.layers.0.mlp.down_proj.weight"
    bad = dict(good)
    bad[bad_name] = bad[bad_name].t().contiguous()  # wrong shape: refused on every rank
    with pytest.raises(Exception) as info:
        llm.collective_rpc("http_load_weights_batch", args=(encode_all(bad),))
    text = str(info.value)
    assert bad_name in text, text
    for _ in range(2):  # each reply is this call's own, from each rank in order
        states = llm.collective_rpc("weight_status")
        assert [s["rank"] for s in states] == [0, 1], states
    assert "2 of 2 ranks" in text and "rank 0: ApplyError" in text, text  # one error, both
    versions = llm.collective_rpc("weight_request_versions")
    assert len(versions) == 2 and all(isinstance(v, dict) for v in versions), versions
    llm.collective_rpc("http_load_weights_batch", args=(encode_all(good),))
    _check(llm, good)
