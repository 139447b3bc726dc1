"""Peer sharing over a sharded version: the coordinator's tracker, the ranks for the rest.

Two trainer ranks run as processes (``shard_procs.py``; rank 0 also runs the
coordinator and so the tracker); each subscriber is a ``peer_share=True`` child
(``peer_procs.py``) that checks every staged tensor against ``det_weights``.
With the default fanout three members hold one stripe each, so every member
fetches a third of each version from the ranks and the rest from the other two;
a member killed or stalled mid-version sends the others to the ranks for its
stripe; a rank killed mid-version costs that version only. Every process is forked
from the zygote (``zygote.py``: torch imported once, so a start costs milliseconds).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.transport.procs import Child, spec_bytes, wait_until

pytestmark = pytest.mark.timeout(120)

SEED = 21


def _start(spawn: Callable[..., Child], specs: list[Any], chunk: int, members: int,
           member_args: dict[str, Any], last_rank_args: dict[str, Any] | None = None,
           ) -> tuple[list[Child], list[Child]]:
    """The rank processes (rank 0 with the coordinator, so the tracker) and ``members``
    peer-sharing children, all started at once once rank 0 says where it is; returns
    them when every member holds a slot of the same plan. All are forked from the
    zygote (torch imported once: milliseconds each) and are processes of their own."""
    rank0 = spawn("shard_rank", forked=True, rank=0, world_size=len(specs), spec=specs[0],
                  seed=SEED, chunk_size=chunk, announce_endpoint="tcp://127.0.0.1:0")
    ready = rank0.event("ready", timeout=60)
    ranks = [rank0] + [spawn("shard_rank", forked=True, rank=rank, world_size=len(specs),
                             spec=spec, seed=SEED, chunk_size=chunk,
                             coordinator=ready["collect"],
                             **((last_rank_args or {}) if rank == len(specs) - 1 else {}))
                       for rank, spec in enumerate(specs[1:], start=1)]
    union = [entry for spec in specs for entry in spec]
    peers = [spawn("peer", forked=True, endpoint=ready["announce"], seed=SEED, spec=union,
                   name=f"m{i}", **member_args) for i in range(members)]
    for child in ranks[1:] + peers:
        child.event("ready", timeout=60)

    def planned() -> bool:
        plans = [_peers(child)["peers"] for child in peers]
        return sorted(p["slot"] for p in plans if p["slot"] is not None) == \
            list(range(members)) and len({p["plan_epoch"] for p in plans}) == 1

    wait_until(planned, 30, "every member in one plan")
    return ranks, peers


def _publish(ranks: list[Child], version: int) -> None:
    for child in ranks:
        child.send(cmd="publish", version=version)
    for child in ranks:
        child.event("published", timeout=30, version=version)


def _peers(child: Child) -> dict[str, Any]:
    return child.request("status")["status"]


def _staged(child: Child, version: int, timeout: float = 60) -> None:
    event = child.event("staged", timeout=timeout, version=version)
    assert event["mismatches"] == [], event


def _sent(ranks: list[Child]) -> tuple[int, int]:
    """Bytes the ranks sent, and the bytes of one version (the shards, padded)."""
    statuses = [child.request("status") for child in ranks]
    return sum(s["bytes_sent"] for s in statuses), sum(s["shard_total"] for s in statuses)


# 3 MiB in all, 48 chunks: at a member's 16 Mbit/s upload a version takes about a second
SPECS = [[("layers.0.w", "float32", [512, 512]), ("embed", "bfloat16", [700, 64])],
         [("layers.1.w", "float32", [256, 1024]), ("head", "float16", [64, 500]),
          ("norm", "float32", [300])]]


def test_peers_share_a_sharded_version_and_a_dead_or_stalled_member_falls_back_to_the_ranks(
    spawn: Callable[..., Child],
) -> None:
    """Three members, the default fanout: three stripes, each member the root of one (it
    fetches that third from the ranks) and a leaf of the others (from the other two).
    Then, on the same processes: a member killed, a member stalled, a rank killed."""
    ranks, members = _start(spawn, SPECS, 64 << 10, 3, {
        "options": {"request_timeout": 2.0, "report_interval": 0.3,
                    "switch_below_fraction": 0.9},
        "peer": {"upload_mbit": 16}}, {"die_serving": 6})
    started = time.monotonic()
    for version in (1, 2):
        _publish(ranks, version)
        for child in members:
            _staged(child, version)
    seconds = time.monotonic() - started
    sent, version_bytes = _sent(ranks)
    total = 2 * version_bytes
    assert version_bytes >= spec_bytes([(n, d, tuple(s)) for n, d, s in SPECS[0] + SPECS[1]])
    statuses = [_peers(child) for child in members]
    from_peers = [s["peers"]["bytes_from_peers"] for s in statuses]
    print(f"2 versions to 3 members in {seconds:.2f}s: the ranks sent {sent / total:.2f}x "
          f"the versions, members got {[round(b / total, 2) for b in from_peers]}x from peers")
    assert all(b > 0 for b in from_peers), from_peers
    assert sum(from_peers) >= total  # a real share: ideally 2x (two thirds each)
    assert total <= sent < 3 * total
    assert all(s["peers"]["stripes"] == 3 and s["checksum_failures"] == 0
               and not s["peers"]["peer_failures"] for s in statuses), statuses

    # a member killed while it feeds the others its stripe: they take that stripe from
    # the ranks instead and stage the version, bit-exact, once
    victim, *alive = members
    _publish(ranks, 3)
    wait_until(lambda: (_peers(alive[0])["fetching_fraction"] or 0) >= 0.15, 30,
               "version 3 under way")
    victim.kill9()
    for child in alive:
        _staged(child, 3, timeout=30)
        status = _peers(child)
        failures = status["peers"]["peer_failures"]
        assert failures.get("disconnected", 0) + failures.get("timeout", 0) >= 1, failures
        assert [e["version"] for e in child.events if e.get("event") == "staged"] == [1, 2, 3]
    _publish(ranks, 4)  # the next version reaches everyone alive
    for child in alive:
        _staged(child, 4)
    after, _ = _sent(ranks)
    print(f"versions 3-4 (a member killed): the ranks sent {(after - sent) / total:.2f}x "
          "a version each")

    # a member that stalls mid-version: the other's requests to it time out (its
    # request_timeout) and go to the ranks; resumed, the stalled one stages it too
    stalled, other = alive
    _publish(ranks, 5)
    wait_until(lambda: (_peers(other)["fetching_fraction"] or 0) >= 0.15, 30,
               "version 5 under way")
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        _staged(other, 5, timeout=30)
        failures = _peers(other)["peers"]["peer_failures"]
        assert failures.get("timeout", 0) >= 1, failures
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    _staged(stalled, 5)

    # a trainer rank killed (kill -9) as the members fetch version 6: rank 1 dies at the
    # first chunk of it that a member asks it for, so no member (and no peer) has a byte
    # of its shard. Version 6 costs only itself: nothing of it is staged, the members keep
    # version 5; rank 1 restarted (a new process, a new port), version 7 follows bit-exact.
    # switch_below_fraction 0.9: v7 replaces the stuck v6 (rank 0's half, ~0.5 of it, in)
    # at once instead of after v6's retries run out (max_chunk_retries x request_timeout)
    started = time.monotonic()
    for child in ranks:
        child.send(cmd="publish", version=6)
    ranks[0].event("published", timeout=30, version=6)
    wait_until(lambda: ranks[1].proc.poll() is not None, 30, "rank 1 killed serving v6")
    assert ranks[1].proc.returncode == -9, ranks[1].stderr_tail()
    for child in alive:
        status = _peers(child)
        assert status["staged_version"] == 5, status
    ranks[1] = spawn("shard_rank", forked=True, rank=1, world_size=2, spec=SPECS[1],
                     seed=SEED, chunk_size=64 << 10,
                     coordinator=ranks[0].event("ready", timeout=1)["collect"])
    ranks[1].event("ready", timeout=60)
    _publish(ranks, 7)
    for child in alive:
        _staged(child, 7)
        staged = [e["version"] for e in child.events if e.get("event") == "staged"]
        assert staged == [1, 2, 3, 4, 5, 7], staged  # never version 6, never part of it
        assert _peers(child)["checksum_failures"] == 0
    print(f"versions 6-7 (rank 1 killed serving 6, restarted): "
          f"{time.monotonic() - started:.2f}s")
