"""The collective data path over gloo, with real processes and real ``kill -9``.

Every case checks each staged version bit-exact against what its trainer
instance derived (``det_weights``) and the data path that brought it. Versions
are 1 MiB in buckets of 128 KiB (8 buckets), so a kill point lands mid-broadcast:

- a trainer and a node receive versions over gloo; a second node joins late and
  is brought into the group, which starts its new epoch with the newest version
  (the late node held it back for the group: it asked to join);
- ten fresh subscriptions in a row, each publishing at once (the node has not
  joined yet, or its epoch is still forming): every version comes by gloo, and
  no fallback happens (each would be counted under a cause);
- ``kill -9`` of a node mid-broadcast: the trainer's ``publish()`` never waits
  on it, the other node gets that version anyway (the round, or ZeroMQ frames)
  and the next ones over gloo once the group is re-formed without the dead one;
- ``kill -9`` of the trainer mid-broadcast: the node stays on its last complete
  version (nothing partial is staged), tears the stale group down, and follows
  the next trainer into a new group, without a restart;
- a bucket corrupted on arrival fails its checksum: that version is fetched over
  ZeroMQ frames, counted under ``checksum`` (status, ``weightpub status``), the
  next one comes by broadcast again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.transport.collective_children import Child
from tests.transport.procs import free_port, wait_until
from weightpub.cli import main as cli_main
from weightpub_wire.collective_layout import FALLBACK_CAUSES

pytestmark = pytest.mark.timeout(120)

SPEC = [("w", "float32", [256, 1024]), ("b", "bfloat16", [333])]  # 1 MiB + a bit: 9 buckets
SPECS = {str(v): SPEC for v in range(1, 13)}
A, B = 101, 202  # seeds of the first and the restarted trainer
TIMEOUT = 5.0  # the announced collective timeout


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.close()


def start(children: list[Child], role: str, **args: Any) -> Child:
    child = Child(role, **args)
    children.append(child)
    return child


def trainer(children: list[Child], seed: int, endpoint: str = "tcp://127.0.0.1:0",
            **args: Any) -> Child:
    return start(children, "trainer", endpoint=endpoint, seed=seed, timeout=TIMEOUT, **args)


def member(children: list[Child], name: str, of: Child, seed: int, **args: Any) -> Child:
    node = start(children, "member", endpoint=of.endpoint, name=name, specs=SPECS, **args)
    node._conn.send(("seed", of.name, seed))
    return node


def group_of(t: Child, members: set[str], timeout: float = 30.0) -> dict[str, Any]:
    def formed() -> dict[str, Any] | None:
        status = t.call("group")[1]
        ok = status["state"] == "active" and set(status["members"]) == members
        return status if ok else None
    return wait_until(formed, timeout, f"a group of {sorted(members)}", interval=0.1)


def staged(node: Child, version: int, timeout: float = 30.0) -> tuple[str, bool]:
    """(data path, bit-exact) of ``version`` at ``node``."""
    message = node.staged(version, timeout)
    return message[3], message[4]


def test_versions_arrive_by_gloo_and_a_late_node_is_brought_into_the_group(children, capsys):
    t = trainer(children, A)
    a = member(children, "node-a", t, A)
    first = group_of(t, {"node-a"})  # the announce in the latest reply is enough to join
    for version in (1, 2, 3):
        t.call("publish", version, SPEC)
        assert staged(a, version) == ("gloo", True)

    b = member(children, "node-b", t, A)
    assert staged(b, 3) == ("gloo", True)  # the new epoch's first round: nobody else needs it
    second = group_of(t, {"node-a", "node-b"})
    assert second["epoch"] > first["epoch"]
    for version in (4, 5):
        t.call("publish", version, SPEC)
        assert staged(a, version) == ("gloo", True)
        assert staged(b, version) == ("gloo", True)
    status = wait_until(lambda: (s := t.call("group")[1])["last_version"] == 5 and s, 10,
                        "the round of version 5 to end")
    assert status["rounds"] >= 4, status
    reports = wait_until(lambda: (r := t.call("fleet")[1]) and len(r) == 2
                         and all(x["applied_version"] == 5 for x in r) and r, 10, "reports")
    assert {r["data_path"] for r in reports} == {"gloo"}, reports
    assert cli_main(["status", t.endpoint]) == 0  # what an operator sees
    out = capsys.readouterr().out
    assert f"collective gloo active, epoch {second['epoch']}, 2 member(s): node-a, node-b" in out
    assert out.count("gloo") >= 3, out  # the group line and each node's path column
    assert "fell back" not in out, out
    for node in (a, b):
        path = node.call("status")[1]["collective"]
        assert path["fallbacks"] == 0 and path["fallback_causes"] == {}, path


def test_a_version_published_right_after_subscribing_comes_by_gloo_ten_times_in_a_row(
        children):
    """Issue 22.1: a node that asked to join before a version is announced gets that
    version by the group, also while its epoch is still forming; here with a long-lived
    member (so every newcomer makes the trainer close an active epoch and re-form)."""
    t = trainer(children, A)
    a = member(children, "node-a", t, A)
    group_of(t, {"node-a"})
    paths = []
    for version in range(1, 11):
        node = member(children, f"fresh-{version}", t, A)
        t.call("publish", version, SPEC)  # at once: the node has not joined any epoch yet
        got = staged(node, version)
        assert staged(a, version) == ("gloo", True)
        path = node.call("status")[1]["collective"]
        paths.append((got, path["fallback_causes"]))
        children.remove(node)
        node.close()  # leaves: the trainer re-forms without it
    assert all(got == ("gloo", True) for got, _ in paths), paths
    assert all(causes == {} for _, causes in paths), paths  # and nothing fell back
    status = a.call("status")[1]["collective"]
    assert status["fallbacks"] == 0 and status["held_back"] == [], status


def test_kill_9_of_a_node_mid_broadcast_leaves_the_trainer_and_the_other_node_working(
        children):
    t = trainer(children, A)
    a = member(children, "node-a", t, A)
    b = member(children, "node-b", t, A, kill_at="die:2:3")
    group_of(t, {"node-a", "node-b"})
    t.call("publish", 1, SPEC)
    assert staged(a, 1) == staged(b, 1) == ("gloo", True)

    published = t.call("publish", 2, SPEC)  # b dies three buckets into this round
    assert published[2] < TIMEOUT, "publish() waited on the broadcast"
    b.wait_killed()
    path, exact = staged(a, 2, timeout=2 * TIMEOUT + 10)  # the round or zmq: never lost
    assert exact, path
    causes = a.call("status")[1]["collective"]["fallback_causes"]
    assert set(causes) <= set(FALLBACK_CAUSES), causes  # a fallback always has a named cause
    assert (path == "zmq") == (sum(causes.values()) == 1), (path, causes)
    assert t.call("publish", 3, SPEC)[2] < TIMEOUT
    assert staged(a, 3, timeout=2 * TIMEOUT + 10)[1]
    group_of(t, {"node-a"})  # re-formed without the dead node
    t.call("publish", 4, SPEC)
    assert staged(a, 4) == ("gloo", True)


def test_kill_9_of_the_trainer_mid_broadcast_keeps_the_node_on_its_version(children):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    first = trainer(children, A, endpoint, kill_at="die:2:3")
    a = member(children, "node-a", first, A)
    group_of(first, {"node-a"})
    first.call("publish", 1, SPEC)
    assert staged(a, 1) == ("gloo", True)
    first._conn.send(("publish", 2, SPEC))  # dies three buckets into the round
    first.wait_killed()
    status = wait_until(lambda: (s := a.call("status")[1])["collective"]["receiver"] == "free"
                        and s, 2 * TIMEOUT, "the node to tear the stale group down")
    with pytest.raises(AssertionError):  # a partial broadcast is never staged
        a.staged(2, timeout=1.0)
    assert status["staged_version"] == 1, status

    second = trainer(children, B, endpoint)  # a new trainer on the same endpoint
    a._conn.send(("seed", second.name, B))
    group_of(second, {"node-a"})  # the node follows it and joins its group, not restarted
    for version in (1, 2):
        second.call("publish", version, SPEC)
        assert staged(a, version) == ("gloo", True)


def test_a_corrupted_bucket_makes_that_version_come_over_zeromq(children, capsys):
    t = trainer(children, A)
    a = member(children, "node-a", t, A, kill_at="corrupt:2:2")  # v2's second bucket
    group_of(t, {"node-a"})
    t.call("publish", 1, SPEC)
    assert staged(a, 1) == ("gloo", True)
    t.call("publish", 2, SPEC)
    assert staged(a, 2) == ("zmq", True)  # the broadcast copy failed its checksum
    status = a.call("status")[1]["collective"]
    assert status["fallbacks"] == 1 and "checksum" in status["last_error"], status
    assert status["fallback_causes"] == {"checksum": 1}, status
    t.call("publish", 3, SPEC)
    assert staged(a, 3) == ("gloo", True)
    group = wait_until(lambda: (g := t.call("group")[1])["fallbacks"] and g, 10,
                       "the node's poll to carry its fallback")
    assert [tuple(f) for f in group["fallbacks"]] == [("node-a", "checksum", 1)], group
    assert cli_main(["status", t.endpoint]) == 0  # what an operator sees
    assert "fell back to zmq: node-a checksum=1" in capsys.readouterr().out
