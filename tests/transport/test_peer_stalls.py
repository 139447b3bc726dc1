"""Stalling peers (sybils): a member that never serves costs one stall, not one per version.

Issue 28 item 6. The stalling members are real ``peer_share=True`` subscriber processes
whose peer server reads every request and answers none (``peer_procs``, ``stall``): they
say hello, stay connected and answer heartbeats, so only their silence gives them away.
With ``peer_fanout=1`` three members form a chain: the honest member (slot 2) asks slot 1,
then slot 0, then the publisher, and both stall.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext.transport.peers.chunk_sources import (
    BACKOFF_MAX_S,
    BACKOFF_S,
    PeerLink,
    Sources,
    stall_timeout,
)
from tests.transport.procs import Child, det_weights
from tests.transport.test_peers import CHUNK, SPEC, join, staged_ok

pytestmark = pytest.mark.timeout(120)


def _status(child: Child) -> dict[str, Any]:
    return child.request("status")


def test_a_stalling_peer_is_asked_once_in_a_version_then_backed_off(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1)

    def forked(role: str, **args: Any) -> Child:
        return spawn(role, forked=True, **args)

    *stallers, honest = join(forked, pub, 3, SPEC,
                             lambda i: {"stall": True} if i < 2 else {}, timeout=10.0)

    def asked() -> list[int]:  # chunks each staller was asked for, all askers together
        return [sum(_status(s)["swallowed"]) for s in stallers]

    def peers() -> dict[str, Any]:
        return _status(honest)["status"]["peers"]

    times = []
    pub.publish(det_weights(77, 1, SPEC), version=1)
    times.append(staged_ok(honest, 1)["fetch_seconds"])
    first = peers()
    # each staller timed out once, after the stall timeout for these chunks (not 10 s)
    assert first["peer_failures"] == {"timeout": 2}, first
    assert first["stall_timeout"] == pytest.approx(stall_timeout(CHUNK, 10.0))
    assert first["chunks_from_peers"] == 0  # everything came from the publisher
    assert sorted(first["backed_off"]) == sorted(first["sources"]), first
    after_first = asked()
    assert all(n >= 1 for n in after_first), after_first
    # the next version, at once: both are backed off, nobody asks them, nothing stalls
    pub.publish(det_weights(77, 2, SPEC), version=2)
    times.append(staged_ok(honest, 2)["fetch_seconds"])
    assert peers()["peer_failures"] == {"timeout": 2}
    assert asked() == after_first
    pub.publish(det_weights(77, 3, SPEC), version=3)
    times.append(staged_ok(honest, 3)["fetch_seconds"])
    assert peers()["peer_failures"] == {"timeout": 2} and asked() == after_first
    print("fetch seconds per version (stalls, backed off, backed off):",
          [round(t, 2) for t in times])


def test_backoff_doubles_per_stall_in_a_row_up_to_a_bound_and_ends_at_a_chunk() -> None:
    sources = Sources(None, lambda key: [], window=4, timeout=5.0,  # type: ignore[arg-type]
                      max_message_bytes=1 << 20, on_open=lambda link: None,
                      on_close=lambda link: None)
    link = PeerLink("tcp://127.0.0.1:1", "", None)  # type: ignore[arg-type]
    bans = []
    for version in range(1, 10):
        sources.fail(link, ("p", version), "timeout", "stalled", 100.0)
        bans.append(link.banned_until - 100.0)
        assert not link.usable(("p", version), 100.0)  # not again in that version
    assert bans == [min(BACKOFF_MAX_S, BACKOFF_S * 2 ** i) for i in range(9)]
    sources.arrived(link, 500.0)
    sources.fail(link, ("p", 10), "timeout", "stalled", 500.0)
    assert link.banned_until == 500.0 + BACKOFF_S  # a chunk in between: a fresh start
    sources.fail(link, ("p", 11), "error", "refused", 1000.0)  # an answer is no stall
    assert link.usable(("p", 12), 1000.0)
    # the stall timeout follows the chunk size: ~1 s for small chunks, longer for big ones
    assert stall_timeout(128 << 10, 5.0) < 1.1 < 5.0 < stall_timeout(64 << 20, 5.0)
    assert stall_timeout(0, 0.3) == 0.3  # a shorter request_timeout is kept


def test_a_peer_that_leaves_the_plan_and_comes_back_is_still_backed_off() -> None:
    import zmq

    from weightpub_wire.peer_protocol import PeerPlan, PeerSource

    ctx = zmq.Context()
    sources = Sources(ctx, lambda key: [], window=4, timeout=5.0, max_message_bytes=1 << 20,
                      on_open=lambda link: None, on_close=lambda link: None)

    def plan(*endpoints: str) -> PeerPlan:
        return PeerPlan(req=1, publisher_id="p" * 32, started_at=1.0, version=1, epoch=1,
                        stripes=1, slot=1, sources=(tuple(PeerSource(e) for e in endpoints),))

    try:
        sybil, other = "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"
        sources.apply(plan(sybil), curve=False)
        sources.fail(sources.links[sybil], ("p", 1), "timeout", "stalled", 100.0)
        banned = sources.links[sybil].banned_until
        sources.apply(plan(other), curve=False)  # it left the plan (its link is closed)
        sources.apply(plan(sybil, other), curve=False)  # and joined again
        back = sources.links[sybil]
        assert (back.stalls, back.banned_until) == (1, banned)
        assert not back.usable(("p", 2), 101.0) and sources.links[other].usable(("p", 2), 101.0)
    finally:
        sources.close()
        ctx.term()


def test_a_peer_on_probation_is_asked_one_chunk_and_its_stripe_goes_on() -> None:
    import zmq

    from weightpub_wire.peer_protocol import PeerPlan, PeerSource

    ctx = zmq.Context()
    sources = Sources(ctx, lambda key: [], window=4, timeout=5.0, max_message_bytes=1 << 20,
                      on_open=lambda link: None, on_close=lambda link: None)
    try:
        parent, grandparent = "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"
        sources.apply(PeerPlan(req=1, publisher_id="p" * 32, started_at=1.0, version=1,
                               epoch=1, stripes=1, slot=2, sources=((
                                   PeerSource(parent), PeerSource(grandparent)),)),
                      curve=False)
        first, second = sources.links[parent], sources.links[grandparent]
        to_peers, to_publisher = sources.route(list(range(8)), ("p", 1), {}, 0.0)
        assert to_peers == {first: [0, 1, 2, 3]} and to_publisher == []  # a full window
        sources.fail(first, ("p", 1), "timeout", "stalled", 0.0)  # backed off 10 s
        to_peers, to_publisher = sources.route(list(range(8)), ("p", 2), {}, 1.0)
        assert to_peers == {second: [0, 1, 2, 3]}  # skipped while backed off
        later = BACKOFF_S + 1.0  # backoff over: probation, one chunk, the rest go on
        to_peers, to_publisher = sources.route(list(range(8)), ("p", 3), {}, later)
        assert to_peers == {first: [0], second: [1, 2, 3, 4]} and to_publisher == []
        to_peers, _ = sources.route([5, 6], ("p", 3), {first: 1, second: 4}, later)
        assert to_peers == {}  # the probe is out: nothing more for it
        sources.arrived(first, later + 0.1)  # it sent its chunk: a full window again
        to_peers, _ = sources.route(list(range(8)), ("p", 3), {}, later + 0.2)
        assert to_peers == {first: [0, 1, 2, 3]}
    finally:
        sources.close()
        ctx.term()
