"""``VersionChoice`` alone: which announced version becomes the target.

The follower (``InstanceFollower``), the budget gate, the back-off and the report
are the real parts; the target's life is a ``FakeLife`` that records each start,
drop and completion, and the sockets a ``FakeSockets`` that records what was sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from subscriber_ext.transport.client.client_report import ClientReport
from subscriber_ext.transport.client.instance_following import InstanceFollower
from subscriber_ext.transport.client.version_choice import VersionChoice
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.delta_assembly import DeltaState
from subscriber_ext.transport.staging.request_table import VersionBackoff
from tests.unit.transport_fakes import NEW, OLD, FakeAssembly, FakeLife, FakeSockets, manifest
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ProtocolError

pytestmark = pytest.mark.timeout(10)


@dataclass
class Rig:
    """A ``VersionChoice`` wired as ``SyncClient`` wires it, around counting stand-ins."""

    budget: int | None = None
    life: FakeLife = field(default_factory=FakeLife)
    sockets: FakeSockets = field(default_factory=FakeSockets)
    deferred: set[int] = field(default_factory=set)  # versions a collective round brings
    switches: list[tuple[str, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.report = ClientReport("sub-1", interval=2.0)
        self.pool = BufferPool(pinned=False, budget_bytes=self.budget)
        self.gate = BudgetGate(self.pool, DeltaState())
        self.backoff = VersionBackoff()
        ids = iter(range(1, 1000))
        self.follower = InstanceFollower(self.sockets, self.report, lambda: next(ids),
                                         self._switched)
        self.choice = VersionChoice(self.life, self.follower, self.gate, self.backoff,
                                    switch_below_fraction=0.5,
                                    defer=lambda m: m.version in self.deferred)

    def _switched(self, publisher_id: str, restarted: bool) -> None:
        self.switches.append((publisher_id, restarted))
        self.choice.switched(restarted)

    def following(self, publisher_id: str = OLD) -> Rig:
        self.follower.follow(publisher_id)
        return self

    def stage(self, version: int) -> None:
        """What ``SyncClient.complete_target`` tells the choice."""
        self.life.target = None
        self.choice.staged(version)


def test_first_confirmed_manifest_follows_its_instance_and_starts() -> None:
    rig = Rig()
    rig.choice.consider(manifest(3), confirmed=True)
    assert rig.switches == [(OLD, False)]
    assert rig.follower.instance == OLD
    assert rig.life.started == [3]
    assert rig.follower.latest_seen == 3


def test_a_newer_manifest_replaces_a_target_less_than_half_received() -> None:
    rig = Rig().following()
    rig.choice.consider(manifest(1))
    assert rig.life.target is not None
    rig.life.target.done_fraction = 0.49
    old = rig.life.target
    rig.choice.consider(manifest(2))
    assert rig.life.dropped == [1] and old.abandoned == 1
    assert rig.life.started == [1, 2]
    assert rig.choice.queued is None


def test_a_newer_manifest_waits_behind_a_target_half_received() -> None:
    rig = Rig().following()
    rig.choice.consider(manifest(1))
    assert rig.life.target is not None
    rig.life.target.done_fraction = 0.5
    rig.choice.consider(manifest(3))
    rig.choice.consider(manifest(2))  # older than the queued one: it stays
    assert rig.life.dropped == [] and rig.life.started == [1]
    assert rig.choice.queued is not None and rig.choice.queued.version == 3
    rig.choice.consider(manifest(4))  # newer: it replaces the queued one
    assert rig.choice.queued.version == 4
    rig.stage(1)
    queued = rig.choice.take_queued()
    assert queued is not None and queued.version == 4 and rig.choice.queued is None


@pytest.mark.parametrize("version", [1, 5])
def test_an_older_or_equal_manifest_is_ignored(version: int) -> None:
    rig = Rig().following()
    rig.stage(5)
    rig.choice.consider(manifest(version))
    assert rig.life.started == [] and rig.life.dropped == []


def test_the_version_being_fetched_or_an_older_one_does_not_restart_it() -> None:
    rig = Rig().following()
    rig.choice.consider(manifest(4))
    rig.choice.consider(manifest(4))
    rig.choice.consider(manifest(3))
    assert rig.life.started == [4] and rig.life.dropped == []


def test_an_unconfirmed_manifest_of_another_instance_only_asks_the_router() -> None:
    rig = Rig().following(OLD)
    rig.choice.consider(manifest(9, NEW))
    assert rig.life.started == [] and rig.follower.instance == OLD
    assert rig.follower.ignored_manifests == 1
    assert isinstance(rig.report.error, ProtocolError)
    assert [type(m) for m in rig.sockets.sent] == [wire.LatestRequest]
    rig.choice.consider(manifest(10, NEW))  # asked less than a second ago: not again
    assert len(rig.sockets.sent) == 1 and rig.follower.ignored_manifests == 2


def test_a_restarted_publisher_is_followed_from_its_first_version() -> None:
    rig = Rig().following(OLD)
    rig.choice.consider(manifest(7))
    assert rig.life.target is not None
    rig.life.target.done_fraction = 0.9
    rig.choice.consider(manifest(8))  # queued behind 7
    rig.choice.consider(manifest(1, NEW), confirmed=True)  # the ROUTER names the new one
    assert rig.switches[-1] == (NEW, True)
    assert rig.life.dropped == [7]  # the old instance's fetch is given up ...
    assert rig.choice.queued is None  # ... and nothing of it waits
    assert rig.choice.current_version == 0
    assert rig.life.started == [7, 1]  # version 1 of the new instance, though 1 < 7
    assert rig.follower.instance == NEW and rig.follower.latest_seen == 1


def test_a_version_waiting_for_memory_holds_it_and_older_ones_back() -> None:
    rig = Rig(budget=6 * 4096).following()
    held = rig.pool.take(4 * 4096)  # a staged version the consumer still holds
    assert not rig.gate.admit(manifest(5))  # what ``start_target`` asked: it waits
    rig.choice.consider(manifest(5))
    rig.choice.consider(manifest(4, chunks=1))
    assert rig.life.started == []
    rig.choice.consider(manifest(6, chunks=1))  # a newer one is considered
    assert rig.life.started == [6]
    rig.pool.give(held)


def test_a_refused_version_is_not_tried_again() -> None:
    rig = Rig(budget=4096).following()
    assert not rig.gate.admit(manifest(5))  # what ``start_target`` asked: never fits
    rig.choice.consider(manifest(5))
    assert rig.life.started == []
    rig.choice.consider(manifest(6, chunks=1))
    assert rig.life.started == [6]


def test_a_version_given_up_waits_for_its_back_off() -> None:
    rig = Rig().following()
    rig.backoff.record(OLD, 6, time.monotonic())
    rig.choice.consider(manifest(6))
    assert rig.life.started == []
    rig.choice.consider(manifest(7))  # a newer version is not held back
    assert rig.life.started == [7]


def test_a_version_the_collective_round_brings_is_not_fetched() -> None:
    rig = Rig(deferred={3}).following()
    rig.choice.consider(manifest(3))
    assert rig.life.started == []
    rig.choice.consider(manifest(4))
    assert rig.life.started == [4]


def test_a_delivered_version_replaces_an_older_fetch() -> None:
    rig = Rig().following()
    rig.choice.consider(manifest(3))
    fetching = rig.life.target
    handed = FakeAssembly(manifest(4))
    rig.choice.deliver(handed)  # type: ignore[arg-type]
    assert fetching is not None and fetching.abandoned == 1 and rig.life.dropped == [3]
    assert rig.life.completed == [handed] and handed.abandoned == 0


def test_a_delivered_version_leaves_a_newer_fetch_alone() -> None:
    rig = Rig().following()
    rig.choice.consider(manifest(6))
    handed = FakeAssembly(manifest(4))
    rig.choice.deliver(handed)  # type: ignore[arg-type]
    assert rig.life.dropped == [] and rig.life.completed == [handed]


def test_a_delivered_version_not_newer_than_the_staged_one_is_released() -> None:
    rig = Rig().following()
    rig.stage(4)
    handed = FakeAssembly(manifest(4))
    rig.choice.deliver(handed)  # type: ignore[arg-type]
    assert handed.abandoned == 1 and rig.life.completed == []


def test_yield_target_gives_up_only_an_older_fetch() -> None:
    rig = Rig().following()
    assert rig.choice.yield_target(5)  # nothing fetched
    rig.choice.consider(manifest(5))
    assert not rig.choice.yield_target(5) and not rig.choice.yield_target(4)
    assert rig.life.dropped == []
    assert rig.choice.yield_target(6)
    assert rig.life.dropped == [5] and rig.life.target is None


def latest_reply(req: int, publisher_id: str, version: int | None = None) -> wire.LatestReply:
    return wire.LatestReply(publisher_id=publisher_id, started_at=1700000000.0, req=req,
                            pub_endpoint="tcp://0.0.0.0:6000", heartbeat_interval=1.0,
                            manifest=None if version is None else manifest(version, publisher_id))


def test_only_the_answer_to_the_newest_latest_request_switches_instance() -> None:
    rig = Rig().following(OLD)
    rig.follower.request_latest(time.monotonic())
    rig.follower.request_latest(time.monotonic())
    first, second = (m.req for m in rig.sockets.sent)
    assert not rig.follower.on_latest(latest_reply(first, NEW))  # an older question's answer
    assert rig.follower.instance == OLD and rig.switches == [(OLD, False)]
    assert rig.follower.on_latest(latest_reply(second, NEW))
    assert rig.switches[-1] == (NEW, True) and rig.follower.instance == NEW
    assert rig.follower.state == "ACTIVE"
    assert rig.sockets.pub_endpoint == "tcp://127.0.0.1:6000"  # its port, our host


def test_a_heartbeat_of_another_instance_is_not_followed() -> None:
    rig = Rig().following(OLD)
    beat = wire.Heartbeat(publisher_id=NEW, started_at=1700000000.0, latest_version=9,
                          sent_at=1700000002.0, interval=1.0)
    rig.follower.on_heartbeat(beat, have=0)
    assert rig.follower.instance == OLD and rig.follower.latest_seen == 0
    assert rig.follower.ignored_manifests == 0  # heartbeats are not counted as manifests
    assert [type(m) for m in rig.sockets.sent] == [wire.LatestRequest]
