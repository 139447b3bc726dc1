"""A rank's ``SliceReceiver`` against a real publisher, without vLLM (issue 30).

The plan recorder is replaced by a plain function (the first half of each tensor):
what is under test is the receiver's part: it fetches through its own sliced
subscription, records a plan again when a version of another layout arrives
(another tensor added: its start is heard; a tensor gone: the plan no longer fits
and the version is refused, which is heard too) and resubscribes, and never offers
a version staged under a plan for another layout. Also the ``receive`` option's
checks and the checkpoint layout read from safetensors headers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.apply.slice_plan import SlicePlan
from subscriber_ext.vllm_ext.receive_choice import AUTO_PENDING, Layout, checkpoint_layout
from subscriber_ext.vllm_ext.slice_receiver import SliceReceiver, layout_key
from subscriber_ext.vllm_ext.slice_rpcs import SliceRpcs
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from weightpub_wire.dtypes import dtype_from_name
from weightpub_wire.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


def _half_plan(layout: Layout) -> SlicePlan:
    plan = SlicePlan()
    for name, dtype, shape in layout:
        size = torch.empty(shape, dtype=dtype_from_name(dtype), device="meta").nbytes
        plan.sizes[name] = size
        plan.ranges[name] = [(0, size // 2)]
    return plan


def _layout(weights: dict[str, torch.Tensor]) -> Layout:
    return tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for n, t in weights.items())


class _Got:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.versions: list[tuple[int, dict[str, torch.Tensor]]] = []

    def __call__(self, staged) -> None:
        with self.cond:  # copy the planned halves out, give the buffer back
            self.versions.append((staged.version, {
                n: t.view(-1)[: t.numel() // 2].clone() for n, t in staged.tensors.items()}))
            self.cond.notify_all()
        staged.release()

    def wait(self, version: int, timeout: float = 30.0) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not any(v == version for v, _ in self.versions):
                left = deadline - time.monotonic()
                assert left > 0, f"version {version} never offered ({self.versions})"
                self.cond.wait(left)
            return next(t for v, t in self.versions if v == version)


def _weights(seed: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(64, 256, generator=gen) for n in names}


def _check_halves(got: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor.view(-1)[: tensor.numel() // 2]), name


def test_the_receiver_replans_for_each_layout_and_offers_only_planned_versions() -> None:
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2, chunk_size=64 << 10)
    planned: list[str] = []

    def plan_for(layout: Layout) -> SlicePlan:
        planned.append(layout_key(layout))
        return _half_plan(layout)

    got = _Got()
    first = _weights(1, ("a", "b"))
    receiver = SliceReceiver(pub.endpoint, rank=1, label="tp2/rank1",
                             options=SubscriberOptions(request_timeout=10.0),
                             plan_for=plan_for, on_version=got, layout=_layout(first))
    try:
        v1 = pub.publish(first)
        _check_halves(got.wait(v1), first)
        status = receiver.status()
        assert status["slices"]["needed_fraction"] == 0.5
        assert status["slice_plan"]["layout"] == "tp2/rank1"
        assert status["slices"]["replans"] == 0

        grown = _weights(2, ("a", "b", "c"))  # a tensor more: its start is heard
        v2 = pub.publish(grown)
        _check_halves(got.wait(v2), grown)
        shrunk = _weights(3, ("a",))  # b and c gone: the plan does not fit, refused, heard
        v3 = pub.publish(shrunk)
        _check_halves(got.wait(v3), shrunk)
        status = receiver.status()
        assert status["slices"]["replans"] == 2 and status["slices"]["replan_failures"] == 0
        assert status["data_path"] in (None, "slices")
        assert len(set(planned)) == 3, planned
        # nothing staged under another layout's plan was offered
        assert [v for v, _ in got.versions] == sorted({v for v, _ in got.versions})
    finally:
        receiver.close()
        pub.close()


def test_a_plan_that_cannot_be_recorded_fetches_whole_versions() -> None:
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)

    def plan_for(layout: Layout) -> SlicePlan:
        raise ValueError("not a slice")

    got = _Got()
    weights = _weights(4, ("a",))
    receiver = SliceReceiver(pub.endpoint, rank=0, label="tp2/rank0",
                             options=SubscriberOptions(request_timeout=10.0),
                             plan_for=plan_for, on_version=got, layout=_layout(weights))
    try:
        version = pub.publish(weights)
        _check_halves(got.wait(version), weights)
        slices = receiver.status()["slices"]
        assert slices["replan_failures"] == 1 and "not a slice" in slices["last_replan_error"]
        assert slices["needed_fraction"] is None
    finally:
        receiver.close()
        pub.close()


def test_receive_option_checks() -> None:
    assert WorkerOptions().receive == "auto"
    assert WorkerOptions.from_wire({"receive": "slices"}, "init_info").receive == "slices"
    with pytest.raises(ConfigError, match="receive"):
        WorkerOptions.from_keywords(receive="sliced")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="node_staging"):
        WorkerOptions.from_keywords(receive="slices", node_staging=True)
    with pytest.raises(ConfigError, match="collective"):
        WorkerOptions.from_keywords(receive="slices", collective=True)
    # ranks of the same layout share their slices with peers (issue 30)
    assert WorkerOptions.from_keywords(receive="slices", peer_share=True).peer_share


def test_the_checkpoint_layout_comes_from_safetensors_headers(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    layout = checkpoint_layout(str(tmp_path))
    assert sorted(layout or ()) == [("b", "bfloat16", (5,)), ("w", "float32", (3, 4))]
    assert checkpoint_layout(str(tmp_path / "missing")) is None
    assert checkpoint_layout("Qwen/Qwen2-0.5B") is None  # a hub name: no local headers
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert checkpoint_layout(str(tmp_path)) is None
    assert layout_key([("a", "float32", (1, 2)), ("b", "float32", (3,))]) == \
        layout_key([("b", "float32", (3,)), ("a", "float32", (1, 2))])
    assert layout_key([("a", "float32", (1, 2))]) != layout_key([("a", "float32", (2, 1))])


def _applied_status(receiver: SliceReceiver, version: int) -> dict:
    """The receiver's status once its subscription reports ``version`` applied."""
    deadline = time.monotonic() + 10
    while True:
        status = receiver.status()
        cost = status.get("applied_received")
        if cost is not None and cost["version"] == version:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.02)


def test_auto_without_a_layout_decides_at_the_first_version_once() -> None:
    """``receive: auto`` with no checkpoint layout: the first version's layout is decided
    once; slices from then on (a later layout is replanned, not decided again), or
    whole for good (a later layout neither decided nor planned)."""
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2, chunk_size=64 << 10)
    asked: list[str] = []
    answers = {"slices": True, "whole": False}
    receivers: dict[str, SliceReceiver] = {}
    got = {name: _Got() for name in answers}
    planned: list[str] = []

    def plan_for(layout: Layout) -> SlicePlan:
        planned.append(layout_key(layout))
        return _half_plan(layout)

    def decider(name: str):
        def decide(layout: Layout) -> bool:
            asked.append(name)
            return answers[name]
        return decide

    try:
        for name in answers:
            receivers[name] = SliceReceiver(
                pub.endpoint, rank=0, label="tp2/rank0",
                options=SubscriberOptions(request_timeout=10.0), plan_for=plan_for,
                on_version=got[name], decide=decider(name))
            assert receivers[name].slicing is None
        first = _weights(5, ("a", "b"))
        v1 = pub.publish(first)
        for name in answers:
            _check_halves(got[name].wait(v1), first)
        grown = _weights(6, ("a", "b", "c"))  # another layout: nobody decides again
        v2 = pub.publish(grown)
        for name in answers:
            _check_halves(got[name].wait(v2), grown)
        assert sorted(asked) == ["slices", "whole"], asked
        for receiver in receivers.values():
            receiver.mark_applied(v2)
        sliced, whole = (_applied_status(receivers[name], v2) for name in ("slices", "whole"))
        assert sliced["slices"]["slicing"] is True and whole["slices"]["slicing"] is False
        assert sliced["slices"]["needed_fraction"] == 0.5 and sliced["data_path"] == "slices"
        assert whole["slices"]["needed_fraction"] is None and whole["slices"]["replans"] == 0
        assert whole["slice_plan"] is None and whole["data_path"] == "zmq"
        # what v2 cost each: half of it as slices, all of it whole
        size = sum(t.nbytes for t in grown.values())
        cost = sliced["applied_received"]
        assert cost["version"] == v2 and cost["version_bytes"] >= size, cost
        assert 0.45 < cost["fraction"] < 0.6 and set(cost["by_source"]) == {"publisher"}, cost
        assert 0.99 < whole["applied_received"]["fraction"] < 1.1, whole["applied_received"]
        # and the publisher's fleet view has each one's share of v2 (the back-channel report)
        deadline = time.monotonic() + 10
        while True:
            shares = {r.data_path: r.received_fraction for r in pub.fleet()
                      if r.applied_version == v2 and r.ranks == (0,)}
            if len(shares) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert shares == {"slices": cost["fraction"],
                          "zmq": whole["applied_received"]["fraction"]}, shares
        # the sliced one replanned for the grown layout (the decision kept), the whole one
        # never planned again
        assert sliced["slices"]["replans"] == 2, sliced["slices"]
        assert len(set(planned)) == 2, planned
        with pytest.raises(ValueError, match="decide"):
            SliceReceiver(pub.endpoint, rank=0, label="x", options=SubscriberOptions(),
                          plan_for=plan_for, on_version=got["whole"], layout=_layout(first),
                          decide=decider("whole"))
    finally:
        for receiver in receivers.values():
            receiver.close()
        pub.close()


class _Worker(SliceRpcs):
    """The extension's receive choice on a stand-in worker: a TP=2 rank whose model is
    ``model`` and whose plan needs ``share`` of each tensor (no vLLM, no collective)."""

    def __init__(self, model: str, share: float | None) -> None:
        parallel = SimpleNamespace(world_size=2, tensor_parallel_size=2,
                                   pipeline_parallel_size=1)
        self.vllm_config = SimpleNamespace(parallel_config=parallel,
                                           model_config=SimpleNamespace(model=model))
        self.rank = 0
        self.share = share

    def _wp_plan_for(self, layout: Layout) -> SlicePlan:
        if self.share is None:
            raise ValueError("no loader")
        plan = _half_plan(layout)
        plan.ranges = {n: [(0, int(plan.sizes[n] * self.share))] for n in plan.sizes}
        return plan

    def _wp_groups(self) -> list:
        return []


def test_auto_decides_at_start_with_a_layout_and_at_the_first_version_without(
        tmp_path: Path) -> None:
    from safetensors.torch import save_file

    layout = _layout(_weights(7, ("a", "b")))
    save_file(_weights(7, ("a", "b")), str(tmp_path / "model.safetensors"))
    choice, planned = _Worker(str(tmp_path), 0.5)._wp_choose_receive(WorkerOptions())
    assert (choice.mode, choice.cause, choice.needed_fraction) == ("slices", "auto", 0.5)
    assert planned is not None and choice.plan_seconds is not None

    worker = _Worker("Org/hub-name", 0.5)  # no local headers: decided at version 1
    choice, planned = worker._wp_choose_receive(WorkerOptions())
    assert (choice.mode, choice.cause, planned) == ("rank", AUTO_PENDING, None)
    assert worker._wp_decide_receive(layout) is True
    receive = worker._wp().receive
    assert receive is not None and receive.status()["mode"] == "slices"
    assert receive.cause == "auto at the first version" and receive.needed_fraction == 0.5
    assert receive.plan_seconds is not None and receive.fallbacks == {}

    for share, cause in ((0.95, "this rank needs 0.95x of a version"),
                         (None, "plan failed: ValueError")):
        worker = _Worker("Org/hub-name", share)
        assert worker._wp_choose_receive(WorkerOptions())[0].cause == AUTO_PENDING
        assert worker._wp_decide_receive(layout) is False
        receive = worker._wp().receive
        assert receive is not None and (receive.mode, receive.cause) == ("rank", cause)
        assert receive.fallbacks == {cause: 1}


def test_what_the_applied_version_cost_survives_a_replan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replan replaces the subscription: the applied version's cost (``received``) and
    the costs of versions the old one staged go with it, so status never shows None for
    a version applied here, whichever subscription staged it. The old subscription's
    close is slowed (as on a loaded box, CI3 of session 15): the new one has staged the
    version by then, and it is told of only once the replan is counted and carried."""
    from subscriber_ext.transport.subscriber import WeightSubscriber

    close = WeightSubscriber.close

    def slow_close(self: WeightSubscriber) -> None:
        time.sleep(0.5)
        close(self)

    monkeypatch.setattr(WeightSubscriber, "close", slow_close)
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2, chunk_size=64 << 10)
    got = _Got()
    first = _weights(1, ("a", "b"))
    receiver = SliceReceiver(pub.endpoint, rank=1, label="tp2/rank1",
                             options=SubscriberOptions(request_timeout=10.0),
                             plan_for=_half_plan, on_version=got, layout=_layout(first))

    def received(version: int) -> dict:
        def now() -> dict | None:
            out = receiver.status()["applied_received"]
            return out if out and out["version"] == version else None
        deadline = time.monotonic() + 10
        while now() is None:
            assert time.monotonic() < deadline, receiver.status()["applied_received"]
            time.sleep(0.05)
        return now() or {}

    try:
        v1 = pub.publish(first)
        got.wait(v1)
        receiver.mark_applied(v1)
        before = received(v1)
        assert before["fraction"] == 0.5 and before["by_source"] == {"publisher": 65536}
        v2 = pub.publish(_weights(2, ("a", "b", "c")))  # another layout: a replan
        got.wait(v2)
        status = receiver.status()
        assert status["slices"]["replans"] == 1
        assert status["applied_received"] == before and status["applied_version"] == v1
        assert status["data_path"] == "slices"
        v3 = pub.publish(_weights(3, ("a",)))  # a replan again, v2 not applied yet
        got.wait(v3)
        assert receiver.status()["slices"]["replans"] == 2
        receiver.mark_applied(v2)  # staged by the replaced subscription
        assert received(v2)["fraction"] == 0.5
        assert receiver.status()["data_path"] == "slices"
        receiver.mark_applied(v3)
        assert received(v3)["version_bytes"] == 64 * 256 * 4
    finally:
        receiver.close()
        pub.close()


def test_an_adopted_record_is_kept_for_its_instance_only() -> None:
    from subscriber_ext.transport.client.client_report import ClientReport, VersionBytes

    old = ClientReport("old", interval=1.0)
    old.staged(4, "slices", VersionBytes(4, 100, {"peers": 50}))
    old.mark_applied(4)
    carry = old.carried("inst-a")
    same, other = ClientReport("new", interval=1.0), ClientReport("new", interval=1.0)
    for report in (same, other):
        report.adopt(carry)
        assert report.applied_version == 4 and report.applied_bytes == carry.applied_bytes
    same.new_instance("inst-a")  # its first contact: the instance the record is of
    other.new_instance("inst-b")  # another instance: version 4 means nothing there
    assert (same.applied_version, same.applied_path) == (4, "slices")
    assert same.applied_bytes is not None and same.applied_bytes.fraction == 0.5
    assert other.applied_version == 0 and other.applied_bytes is None
    told_first = ClientReport("new", interval=1.0)
    told_first.mark_applied(4)  # told before the record came: no cost known yet
    assert told_first.applied_bytes is None
    told_first.adopt(carry)
    assert told_first.applied_bytes == carry.applied_bytes


def test_ranks_deciding_differently_at_the_first_version_still_commit_together() -> None:
    """``receive: auto`` without a layout decides per rank at the first version, with no
    agreement: one rank may slice while another stays whole. Why nothing breaks: such a
    rank never joins node staging (pending, every rank runs its own ``SliceReceiver``;
    deciding whole keeps that subscription, ``_wp_decide_receive`` never answers
    "node": see the test above), and the commit is agreed on the versions every rank
    holds, whatever brought them (``RankAgreement`` over a real gloo group here). A
    rank that replans to slices and is late holds the commit; each rank applies what
    its own loaders read."""
    import datetime

    import torch.distributed as dist

    from subscriber_ext.vllm_ext.commit.coordinator import CommitCoordinator
    from subscriber_ext.vllm_ext.commit.strategies import RankAgreement
    from tests.unit.test_commit_coordinator import TwoRanks

    store = dist.HashStore()
    groups: list = [None, None]
    TwoRanks._both(lambda r: groups.__setitem__(r, dist.ProcessGroupGloo(
        store, r, 2, datetime.timedelta(seconds=10))))
    applied: list[list[dict[str, torch.Tensor]]] = [[], []]
    coords = [CommitCoordinator(lambda tensors, r=r: applied[r].append(
        {n: t.clone() for n, t in tensors.items()}), RankAgreement([groups[r]], keep=2), keep=2)
        for r in range(2)]
    held_back: list = []  # rank 0's version 2, offered when the test says (a slow rank)

    def on_version(rank: int):
        def offer(staged) -> None:
            if rank == 0 and staged.version == 2:
                held_back.append(staged)
                return
            coords[rank].offer(staged)
        return offer

    def commit() -> list:
        out: list = [None, None]
        TwoRanks._both(lambda r: out.__setitem__(r, coords[r].commit_pending()))
        return out

    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2, chunk_size=64 << 10)
    receivers = [SliceReceiver(pub.endpoint, rank=r, label=f"tp2/rank{r}",
                               options=SubscriberOptions(request_timeout=10.0),
                               plan_for=_half_plan, on_version=on_version(r),
                               decide=lambda layout, r=r: r == 0)  # rank 0 slices
                 for r in range(2)]
    try:
        weights = {1: _weights(8, ("a", "b")), 2: _weights(9, ("a", "b"))}
        pub.publish(weights[1], version=1)
        wait = time.monotonic() + 30
        while not all(c.staged_version() == 1 for c in coords):
            assert time.monotonic() < wait, [c.staged_version() for c in coords]
            time.sleep(0.02)
        assert [r.slicing for r in receivers] == [True, False]  # decided differently
        assert commit() == [1, 1]
        pub.publish(weights[2], version=2)
        while not (coords[1].staged_version() == 2 and held_back):
            assert time.monotonic() < wait + 30, coords[1].staged_version()
            time.sleep(0.02)
        assert commit() == [1, 1]  # rank 0 (sliced) does not hold 2 yet: nobody moves
        coords[0].offer(held_back.pop())
        assert commit() == [2, 2]
        for version, (sliced, whole) in ((1, (applied[0][0], applied[1][0])),
                                         (2, (applied[0][1], applied[1][1]))):
            _check_halves({n: t.view(-1)[: t.numel() // 2] for n, t in sliced.items()},
                          weights[version])
            assert all(torch.equal(whole[n], t) for n, t in weights[version].items())
        assert [c.applied_data_path for c in coords] == ["slices", "zmq"]
    finally:
        for receiver in receivers:
            receiver.close()
        for coord in coords:
            coord.close()
        pub.close()
