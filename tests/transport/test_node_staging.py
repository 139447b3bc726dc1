"""One staging per node, with real processes: two "local ranks" share one subscription.

What a TP=2 replica does inside vLLM (``tests/vllm/test_node_staging.py``), here
without vLLM: the publisher serves each version once (counted by a TCP relay in
front of it), both ranks get the same verified bytes from one shared mapping, the
publisher lists one subscriber with both ranks, and ``kill -9`` of either rank
leaves no memory pinned or mapped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from publisher import WeightPublisher
from subscriber_ext.transport.node.node_join import node_label
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import Child, det_weights, digests, spec_bytes, wait_until
from tests.transport.shm_probe import memfd_holders, our_shm_files

pytestmark = pytest.mark.timeout(120)

SEED = 71
SPEC = [("embed", "bfloat16", [1024, 512]), ("proj", "float32", [512, 384]),
        ("norm", "float32", [512]), ("step", "int64", [])]
OPTIONS = {"request_timeout": 30.0, "report_interval": 0.2}  # no refetch on a busy machine


@pytest.fixture
def relay(make_pub: Callable[..., WeightPublisher]) -> Iterator[tuple[WeightPublisher, ByteRelay]]:
    pub = make_pub(chunk_size=256 << 10)
    relay = ByteRelay.in_front_of(pub.endpoint)
    yield pub, relay
    relay.close()


def _ranks(spawn: Callable[..., Child], endpoint: str, key: str,
           **args: object) -> dict[str, Child]:
    args = {"options": OPTIONS, **args}
    children = [spawn("node_rank", endpoint=endpoint, key=key, rank=r, **args) for r in (0, 1)]
    roles = {c.event("ready", timeout=60)["role"]: c for c in children}
    assert set(roles) == {"owner", "follower"}, roles  # exactly one rank owns the node
    return roles


def _mapped_inodes(pid: int, label: str) -> set[int]:
    return memfd_holders(f"weightpub-stage-{label}").get(pid, set())


def test_two_local_ranks_share_one_subscription_and_one_staged_copy(
    relay: tuple[WeightPublisher, ByteRelay], spawn: Callable[..., Child],
) -> None:
    pub, counter = relay
    key = f"test-{uuid.uuid4().hex}"
    roles = _ranks(spawn, counter.endpoint, key)
    total = spec_bytes(SPEC)
    for version in (1, 2, 3):
        pub.publish(det_weights(SEED, version, SPEC))
        expected = digests(det_weights(SEED, version, SPEC).items())
        for child in roles.values():
            got = child.event("staged", timeout=30, version=version)
            assert got["digests"] == expected and got["publisher_id"] == pub.publisher_id

    fleet = wait_until(lambda: [r for r in pub.fleet() if r.applied_version == 3], 30,
                       "the node to report version 3 applied by both ranks")
    assert len(pub.fleet()) == 1, pub.fleet()  # one subscriber for the node
    assert fleet[0].ranks == (0, 1) and fleet[0].last_error is None
    # each version crossed the publisher's socket once (chunks + small replies)
    assert 3 * total <= counter.bytes_down <= 3 * total * 1.01 + (64 << 10), \
        (counter.bytes_down, total)
    # the follower maps the owner's staging memory: the same memfd, no copy of its own
    label = node_label(key)
    owner, follower = roles["owner"].pid, roles["follower"].pid
    assert _mapped_inodes(follower, label)
    assert _mapped_inodes(follower, label) <= _mapped_inodes(owner, label)
    status = wait_until(lambda: (s := roles["follower"].request("status")["status"])
                        and s["staged_version"] == 3 and s, 10, "the owner's status")
    assert status["node_staging"]["role"] == "follower"
    assert status["node_staging"]["owner_rank"] == roles["owner"].events[0]["rank"]


def test_every_rank_sees_the_version_grow_with_final_bytes_only(
    relay: tuple[WeightPublisher, ByteRelay], spawn: Callable[..., Child],
) -> None:
    """Per-layer readiness reaches every rank: owner and follower both get the arriving
    version's final prefix (the bytes they are told are ready equal the published
    ones) before the complete version, under the same attempt."""
    pub, counter = relay
    spec = [(f"layers.{i}.w", "float32", [64, 256]) for i in range(16)]  # 64 KiB each
    roles = _ranks(spawn, counter.endpoint, f"test-{uuid.uuid4().hex}", progress=True,
                   options={**OPTIONS, "window_bytes": 512 << 10})
    wait_until(lambda: roles["owner"].request("status")["status"]["node_staging"]["ranks"]
               == [0, 1], 30, "the follower to attach")
    weights = det_weights(SEED, 1, spec)
    pub.publish(weights)
    expected = digests(weights.items())
    for role, child in roles.items():
        staged = child.event("staged", timeout=30, version=1)
        partials = [e for e in child.events if e.get("event") == "partial"]
        assert len(partials) >= 2, (role, partials)  # seen growing, not only at the end
        assert {p["attempt"] for p in partials} == {staged["attempt"]} and staged["attempt"]
        counts = [p["ready"] for p in partials]
        assert counts == sorted(counts) and counts[-1] <= len(spec), (role, counts)
        told = {k: v for p in partials for k, v in p["digests"].items()}
        assert told == {k: expected[k] for k in told}, role  # only final bytes were "ready"
        assert not any(p["cancelled"] for p in partials)


def test_killed_ranks_pin_nothing_and_leave_nothing_mapped(
    relay: tuple[WeightPublisher, ByteRelay], spawn: Callable[..., Child],
) -> None:
    pub, counter = relay
    key = f"test-{uuid.uuid4().hex}"
    label = node_label(key)
    shm_before = our_shm_files(foreign_engines=False)
    roles = _ranks(spawn, counter.endpoint, key, hold=True)
    owner = roles["owner"]
    pub.publish(det_weights(SEED, 1, SPEC))
    for child in roles.values():
        child.event("staged", timeout=30, version=1)

    def shared_versions() -> list[int]:
        return owner.request("status")["status"]["node_staging"]["shared_versions"]

    # a follower killed while it holds version 1: the owner stops counting it
    roles["follower"].kill9()
    wait_until(lambda: owner.request("status")["status"]["node_staging"]["ranks"] == [
        owner.events[0]["rank"]], 30, "the owner to drop the killed rank")
    assert shared_versions() == [1]  # the owner itself still holds it
    owner.request("release")
    wait_until(lambda: shared_versions() == [], 30, "version 1 to be released by every rank")

    # a new rank attaches and gets the next version from the same owner
    newcomer = spawn("node_rank", endpoint=counter.endpoint, key=key, rank=1, options=OPTIONS,
                     hold=True)
    assert newcomer.event("ready", timeout=60)["role"] == "follower"
    pub.publish(det_weights(SEED, 2, SPEC))
    for child in (owner, newcomer):
        child.event("staged", timeout=30, version=2)

    # the owner killed: the follower keeps its views (still mapped), learns the owner is gone
    owner.kill9()
    wait_until(lambda: "owner lost" in str(newcomer.request("status")["status"]["last_error"]),
               30, "the follower to notice the owner is gone")
    assert set(memfd_holders(f"weightpub-stage-{label}")) == {newcomer.pid}
    newcomer.request("release")
    wait_until(lambda: not memfd_holders(f"weightpub-stage-{label}"), 30,
               "no process to map the node's staging memory")
    newcomer.close()
    assert our_shm_files(foreign_engines=False) == shm_before  # nothing of ours in /dev/shm either


def test_shm_entries_of_killed_engines_are_reaped_at_the_next_start(tmp_path: Path) -> None:
    """weightpub's named /dev/shm entries: the engine's slot table (unlinked once its workers
    mapped it) and the front end's status directory (removed at exit). One left by a
    process killed before that is removed by the next engine's ``SlotTable.create`` /
    the next front end's ``StatusBoard.create``; staging itself has no name (memfd)."""
    from subscriber_ext.observe.status_board import reap_orphaned_boards
    from subscriber_ext.vllm_ext.commit.shared_slots import reap_stale_tables

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"weightpub-{dead.pid}-0123456789ab"
    live = tmp_path / f"weightpub-{os.getpid()}-0123456789ab"
    other = tmp_path / "vllm_dist_something"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    stale_board = tmp_path / f"weightpub-status-{dead.pid}-k3j2h1"
    live_board = tmp_path / f"weightpub-status-{os.getpid()}-k3j2h1"
    for board in (stale_board, live_board):
        board.mkdir()
        (board / "rank0.json").write_text("{}")
    assert reap_stale_tables(str(tmp_path)) == [stale.name]
    reap_orphaned_boards(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
    assert not stale_board.exists() and live_board.exists()
