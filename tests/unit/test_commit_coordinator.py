"""``CommitCoordinator`` alone: what it holds, commits, refuses and releases.

No engine and no transport: staged versions are small stand-ins that count
their releases, ``apply`` records which version's tensors it was given. The
strategies are the real ones: ``RankAgreement`` (a world of one, or two ranks on
threads over a real gloo group) and ``EngineDriven`` with the engine core's own
``EngineDriver`` reading a real slot table.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.commit.coordinator import CommitCoordinator
from subscriber_ext.vllm_ext.commit.engine_driver import COMMIT_RPC, EngineDriver
from subscriber_ext.vllm_ext.commit.shared_slots import SlotReader, SlotTable, SlotWriter
from subscriber_ext.vllm_ext.commit.strategies import CommitStrategy, EngineDriven, RankAgreement

OLD, NEW = "a" * 32, "b" * 32  # two publisher instances
WAIT_S = 10.0


@dataclass
class Ledger:
    """What the coordinator was given, applied and released, per (publisher, version)."""

    released: Counter[tuple[str, int]] = field(default_factory=Counter)
    applied: list[tuple[str, int]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    fail_versions: set[int] = field(default_factory=set)
    given: dict[int, tuple[str, int]] = field(default_factory=dict)

    def staged(self, version: int, publisher_id: str = OLD) -> Staged:
        return Staged(version, publisher_id, self)

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        key = self.given[id(tensors)]  # the staged version these tensors came from
        if key[1] in self.fail_versions:
            raise ValueError(f"bad tensor in version {key[1]}")
        self.applied.append(key)

    def coordinator(self, strategy: CommitStrategy, **kwargs: Any) -> CommitCoordinator:
        return CommitCoordinator(
            self.apply, strategy, on_commit=self.committed.append,
            on_failure=lambda v, exc: self.failures.append((v, str(exc))), **kwargs)


class Staged:
    """A staged version (``StagedLike``) that counts its releases in the ledger."""

    def __init__(self, version: int, publisher_id: str, ledger: Ledger) -> None:
        self.version = version
        self.publisher_id = publisher_id
        self.tensors = {"w": torch.full((4,), float(version))}
        self.total_bytes = 16
        self._ledger = ledger
        ledger.given[id(self.tensors)] = (publisher_id, version)

    def release(self) -> None:
        self._ledger.released[(self.publisher_id, self.version)] += 1


def alone() -> RankAgreement:
    """A world of one rank: the real agreement, no collective."""
    return RankAgreement([], keep=2)


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- a restarted publisher ------------------------------------------------------------------
def test_publisher_restart_drops_staged_versions_of_the_old_instance() -> None:
    ledger = Ledger()
    coord = ledger.coordinator(alone(), keep=3)
    coord.offer(ledger.staged(1))
    assert coord.commit_pending() == 1
    coord.offer(ledger.staged(2))
    coord.offer(ledger.staged(3))
    assert coord.staged_version() == 3

    coord.offer(ledger.staged(1, NEW))  # the new instance counts from 1 again

    # the old instance's staged versions are released once each, never applied
    assert ledger.released[(OLD, 2)] == 1 and ledger.released[(OLD, 3)] == 1
    assert coord.applied_version is None  # "1" of the old instance means nothing now
    assert coord.staged_version() == 1
    assert coord.commit_pending() == 1
    assert ledger.applied == [(OLD, 1), (NEW, 1)]
    assert coord.publisher_id == NEW
    assert ledger.released[(NEW, 1)] == 1  # released once it is live (the model has it)
    assert sum(ledger.released.values()) == 4  # OLD 1, 2, 3 and NEW 1: nothing twice


def test_a_late_version_of_the_old_instance_is_not_committed_after_a_restart() -> None:
    ledger = Ledger()
    coord = ledger.coordinator(alone())
    coord.offer(ledger.staged(5))
    coord.offer(ledger.staged(1, NEW))
    assert ledger.released[(OLD, 5)] == 1
    assert coord.commit_pending() == 1
    assert ledger.applied == [(NEW, 1)]


# -- a failed version -----------------------------------------------------------------------
def test_a_failed_version_is_never_offered_for_commit_again() -> None:
    ledger = Ledger(fail_versions={2})
    strategy = alone()
    coord = ledger.coordinator(strategy)
    coord.offer(ledger.staged(1))
    assert coord.commit_pending() == 1
    coord.offer(ledger.staged(2))
    assert coord.commit_pending() == 1  # failed: the old weights stay
    assert [v for v, _ in ledger.failures] == [2]
    assert coord.last_error is not None and "version 2" in coord.last_error
    assert ledger.released[(OLD, 2)] == 1

    coord.offer(ledger.staged(2))  # the transport stages it again (a retry, a re-sync)
    assert strategy._held == []  # held, but not advertised as committable
    assert coord.commit_pending() == 1
    assert ledger.applied == [(OLD, 1)]
    assert [v for v, _ in ledger.failures] == [2]  # not even tried again

    coord.offer(ledger.staged(3))
    assert coord.commit_pending() == 3
    assert ledger.applied == [(OLD, 1), (OLD, 3)]
    assert ledger.released[(OLD, 2)] == 2  # the second copy too, once 3 is live
    assert ledger.committed == [1, 3]


def test_a_restarted_publisher_may_reuse_a_failed_number() -> None:
    ledger = Ledger(fail_versions={2})
    coord = ledger.coordinator(alone())
    coord.offer(ledger.staged(2))
    assert coord.commit_pending() is None
    ledger.fail_versions.clear()
    coord.offer(ledger.staged(2, NEW))  # another instance's "2" is another version
    assert coord.commit_pending() == 2
    assert ledger.applied == [(NEW, 2)]


# -- an unready rank holds the commit (ranks agree among themselves) -------------------------
class TwoRanks:
    """Two coordinators, one per thread-rank, agreeing over a real gloo group each."""

    def __init__(self, ledgers: list[Ledger], gates: list[dict[int, threading.Event]]) -> None:
        store = dist.HashStore()
        groups: list[Any] = [None, None]

        def make(rank: int) -> None:
            groups[rank] = dist.ProcessGroupGloo(store, rank, 2,
                                                 datetime.timedelta(seconds=WAIT_S))

        self._both(make)
        self.coords = [
            ledgers[r].coordinator(
                RankAgreement([groups[r]], keep=2), keep=2,
                prepare=self._prepare(gates[r]), apply_prepared=self._swap(ledgers[r]),
                prepare_policy="always")
            for r in range(2)
        ]

    @staticmethod
    def _prepare(gates: dict[int, threading.Event]) -> Callable[[Any], PreparedVersion]:
        def prepare(staged: Any) -> PreparedVersion:
            gate = gates.get(staged.version)
            if gate is not None:
                assert gate.wait(WAIT_S), "test gate never opened"
            return PreparedVersion(version=staged.version, publisher_id=staged.publisher_id)
        return prepare

    @staticmethod
    def _swap(ledger: Ledger) -> Callable[[PreparedVersion, Any], None]:
        def swap(prepared: PreparedVersion, tensors: Any) -> None:
            ledger.applied.append((prepared.publisher_id, prepared.version))
        return swap

    @staticmethod
    def _both(work: Callable[[int], None]) -> None:
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                work(rank)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,), name=f"weightpub-test-rank{r}")
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "a rank hung in the collective"
        assert not errors, errors

    def commit_pending(self) -> list[int | None]:
        result: list[int | None] = [None, None]

        def commit(rank: int) -> None:
            result[rank] = self.coords[rank].commit_pending()

        self._both(commit)
        return result

    def settled(self) -> bool:
        return all(not (c.prepare_status() or {}).get("preparing") for c in self.coords)

    def close(self) -> None:
        for c in self.coords:
            c.close()


@pytest.fixture
def two_ranks() -> Iterator[tuple[TwoRanks, list[Ledger], dict[int, threading.Event]]]:
    ledgers = [Ledger(), Ledger()]
    slow = {2: threading.Event()}  # rank 1 prepares version 2 only when told
    ranks = TwoRanks(ledgers, [{}, slow])
    yield ranks, ledgers, slow
    slow[2].set()
    ranks.close()


def test_an_unready_rank_holds_the_commit(
        two_ranks: tuple[TwoRanks, list[Ledger], dict[int, threading.Event]]) -> None:
    ranks, ledgers, slow = two_ranks
    for r in range(2):
        ranks.coords[r].offer(ledgers[r].staged(1))
    wait_until(ranks.settled, "version 1 prepared on both ranks")
    assert ranks.commit_pending() == [1, 1]

    for r in range(2):
        ranks.coords[r].offer(ledgers[r].staged(2))
    wait_until(lambda: not (ranks.coords[0].prepare_status() or {})["preparing"],
               "version 2 prepared on rank 0")
    assert ranks.coords[1].prepare_status()["preparing"] == [2]  # type: ignore[index]
    # rank 0 could commit 2, rank 1 is still preparing it: nobody moves
    assert ranks.commit_pending() == [1, 1]
    assert ranks.commit_pending() == [1, 1]
    assert [ledger.applied for ledger in ledgers] == [[(OLD, 1)], [(OLD, 1)]]
    assert ledgers[0].released[(OLD, 2)] == 0  # rank 0 keeps it for the common commit

    slow[2].set()
    wait_until(ranks.settled, "version 2 prepared on rank 1")
    assert ranks.commit_pending() == [2, 2]
    assert [ledger.applied for ledger in ledgers] == [[(OLD, 1), (OLD, 2)]] * 2
    assert [ledger.released[(OLD, 2)] for ledger in ledgers] == [1, 1]


# -- engine-driven: the engine chooses, the ranks commit exactly that -----------------------
class Engine:
    """The engine core's real ``EngineDriver`` over a real slot table, ranks called directly."""

    def __init__(self, ledgers: list[Ledger], keep: int) -> None:
        self.table = SlotTable.create(len(ledgers))
        self.writers = [SlotWriter(self.table, i) for i in range(len(ledgers))]
        self.coords = [ledger.coordinator(EngineDriven(w), keep=keep)
                       for ledger, w in zip(ledgers, self.writers, strict=True)]
        self.during_rpc: Callable[[], None] = lambda: None
        self.rpcs: list[tuple[str, tuple[int, int]]] = []
        self.driver = EngineDriver(self.table, self._rpc)
        self.core = SimpleNamespace(batch_queue=None, _weight_version="0", scheduler=None)

    def _rpc(self, core: Any, method: str, args: tuple[int, int]) -> list[Any]:
        self.rpcs.append((method, args))
        self.during_rpc()  # e.g. the subscriber thread offers a newer version meanwhile
        return [c.commit(*args) for c in self.coords]

    def step(self) -> bool:
        return self.driver.maybe_commit(self.core)

    def close(self) -> None:
        for c in self.coords:
            c.close()
        for w in self.writers:
            w.waker.close()
        self.table.unlink()


def test_the_engine_commits_the_newest_common_version_not_each_rank_s_newest() -> None:
    ledgers = [Ledger(), Ledger()]
    engine = Engine(ledgers, keep=2)
    try:
        for v in (1, 2):
            engine.coords[0].offer(ledgers[0].staged(v))
        engine.coords[1].offer(ledgers[1].staged(1))
        assert [c.commit_pending() for c in engine.coords] == [None, None]  # engine's job
        assert engine.step()
        assert engine.rpcs[-1][0] == COMMIT_RPC and engine.rpcs[-1][1][0] == 1
        assert [ledger.applied for ledger in ledgers] == [[(OLD, 1)], [(OLD, 1)]]
        assert ledgers[0].released[(OLD, 2)] == 0  # rank 0 still holds 2 for later
        assert not engine.step()  # nothing new: no RPC

        engine.coords[1].offer(ledgers[1].staged(2))
        assert engine.step()
        assert [ledger.applied[-1] for ledger in ledgers] == [(OLD, 2), (OLD, 2)]
        assert [c.applied_version for c in engine.coords] == [2, 2]
    finally:
        engine.close()


def test_the_engine_s_intent_is_pinned_while_a_newer_version_pushes_it_out() -> None:
    ledger = Ledger()
    engine = Engine([ledger], keep=1)
    try:
        coord = engine.coords[0]
        coord.offer(ledger.staged(1))
        seen_during_rpc: list[int] = []

        def newer_arrives() -> None:  # between the engine's choice and its RPC
            assert engine.table.intent == 1
            coord.offer(ledger.staged(2))  # keep=1: version 1 is pushed out of the holder...
            seen_during_rpc.append(ledger.released[(OLD, 1)])  # ...but not released

        engine.during_rpc = newer_arrives
        assert engine.step()
        assert seen_during_rpc == [0]
        assert ledger.applied == [(OLD, 1)]  # what the engine chose, not the newest held
        assert ledger.released[(OLD, 1)] == 1 and ledger.released[(OLD, 2)] == 0
        assert engine.table.intent == -1
        snap = SlotReader(engine.table).snapshot()
        assert snap is not None and snap[0][1:] == (1, (2,))  # applied 1, holds 2

        engine.during_rpc = lambda: None
        assert engine.step()
        assert ledger.applied == [(OLD, 1), (OLD, 2)]
    finally:
        engine.close()


def test_without_an_intent_a_pushed_out_version_is_released_at_once() -> None:
    # the control for the pin above: the same push with no engine mid-commit
    ledger = Ledger()
    engine = Engine([ledger], keep=1)
    try:
        coord = engine.coords[0]
        coord.offer(ledger.staged(1))
        coord.offer(ledger.staged(2))
        assert ledger.released[(OLD, 1)] == 1
        assert coord.commit(1) is None  # no longer staged here: nothing applied
        assert coord.last_error == "version 1: not staged on this rank"
        assert ledger.applied == []
    finally:
        engine.close()


def test_a_commit_for_another_publisher_s_version_is_refused() -> None:
    ledger = Ledger()
    engine = Engine([ledger], keep=2)
    try:
        coord = engine.coords[0]
        coord.offer(ledger.staged(1))
        assert coord.commit(1, publisher_hash=12345) is None  # the engine named another one
        assert ledger.applied == [] and ledger.released[(OLD, 1)] == 0
        assert engine.step()
        assert ledger.applied == [(OLD, 1)]
    finally:
        engine.close()
