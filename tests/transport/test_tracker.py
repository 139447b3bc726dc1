"""The tracker's plan: striped trees that carry each chunk out of the trainer once.

Pure logic (no sockets): the plan for many fleet sizes and fan-outs, and the
tracker's answers as members join, die and reconnect between versions.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import zmq

from publisher.serving.tracker import Plan, Tracker, TrackerLimits, advertised_endpoint
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError
from weightpub_wire.peer_protocol import MAX_STRIPES, PeerHello, PeerPlan, PeerSource

PUB = "p" * 32


def ids(n: int) -> list[bytes]:
    return [f"member-{i}".encode() for i in range(n)]


@pytest.mark.parametrize("n,fanout", [(1, 4), (2, 4), (3, 4), (5, 4), (16, 4), (17, 4),
                                      (16, 2), (64, 3), (100, 4), (1000, 4), (300, 16)])
def test_every_member_gets_each_stripe_once_and_uploads_about_one_version(
        n: int, fanout: int) -> None:
    plan = Plan(ids(n), fanout, 1, 1)
    stripes = plan.stripes
    assert stripes == min(n, fanout)
    children = [0] * n  # stripe-edges below each member: each is 1/stripes of a version
    for stripe in range(stripes):
        roots = [s for s in range(n) if not plan.ancestors(s, stripe)]
        assert roots == [stripe]  # the only member of this stripe fed by the trainer
        for slot in range(n):
            chain = plan.ancestors(slot, stripe)
            if chain:
                children[chain[0]] += 1
                assert chain[-1] == stripe and len(set(chain)) == len(chain)
            assert len(chain) <= math.ceil(math.log(max(n, 2), max(stripes, 2))) + 1
            below = plan.descendants(slot, stripe, 1)
            assert all(plan.ancestors(c, stripe)[0] == slot for c in below)
    # the trainer sends each chunk once (one root per stripe); each member uploads about
    # one version: ``stripes`` children in its own stripe, a few more where its group has
    # fewer members than the tree has inner positions (small fleets, wide fan-outs)
    uploads = [c / stripes for c in children]
    assert sum(children) == stripes * (n - 1)
    assert max(uploads, default=0) <= (1.0 if n >= stripes * stripes and stripes <= 4
                                       else 2.0)


def hello(tracker: Tracker, who: bytes, version: int, *, latest: int, now: float,
          port: int | None = None, key: str | None = None,
          address: str = "10.0.0.9", plan: str = "") -> PeerPlan:
    port = port if port is not None else 20000 + int(who.split(b"-")[1])
    message = PeerHello(req=1, publisher_id=PUB, endpoint=f"tcp://0.0.0.0:{port}",
                        version=version, plan=plan)
    return tracker.hello(who, message, address, key, now, latest)


def test_members_join_and_die_between_versions() -> None:
    # five plaintext members on one address: more than max_members_per_address allows
    tracker = Tracker(TrackerLimits(fanout=2, member_ttl=4.0, max_members_per_address=0),
                      PUB, 1.0)
    members = ids(4)
    for index, who in enumerate(members):
        plan = hello(tracker, who, 0, latest=0, now=0.0)
        assert plan.slot == index  # nothing published yet: the plan follows every join
    plans = {who: hello(tracker, who, 1, latest=1, now=1.0) for who in members}
    first = plans[members[0]]  # root of stripe 0; stripe 1 comes down from member 1
    assert first.sources[0] == () and first.sources[1][-1] == PeerSource("tcp://10.0.0.9:20001")
    assert plans[members[3]].stripes == 2 and all(plans[members[3]].sources)
    # a fifth member joins during version 1: no place until the next version
    late = f"member-{4}".encode()
    assert hello(tracker, late, 1, latest=1, now=1.5).stripes == 0
    # member 0 goes silent; while version 1 lasts its children are sent to the grandparent
    for who in members[1:] + [late]:
        hello(tracker, who, 1, latest=1, now=5.5)
    during = hello(tracker, members[1], 1, latest=1, now=5.6)
    assert all("20000" not in s.endpoint for chain in during.sources for s in chain)
    # version 2: member 0 is out, the late member is in, nobody else moved but the last
    after = {who: hello(tracker, who, 2, latest=2, now=6.0) for who in members[1:] + [late]}
    assert sorted(p.slot for p in after.values()) == [0, 1, 2, 3]
    assert after[members[3]].slot == 0  # the last member filled the hole
    assert after[members[1]].slot == 1 and after[members[2]].slot == 2
    assert after[late].slot == 3  # the newcomer is appended
    assert after[late].epoch > plans[members[0]].epoch


def test_a_reconnecting_member_keeps_its_slot() -> None:
    tracker = Tracker(TrackerLimits(fanout=2), PUB, 1.0)
    for who in ids(3):
        hello(tracker, who, 0, latest=0, now=0.0)
    hello(tracker, b"member-1-again", 1, latest=1, now=1.0, port=20001)  # same endpoint
    assert tracker.members() == 3
    assert hello(tracker, b"member-1-again", 1, latest=1, now=1.1, port=20001).slot == 1


def test_curve_keys_travel_with_sources_and_admission() -> None:
    tracker = Tracker(TrackerLimits(fanout=1), PUB, 1.0)
    keys = [zmq.curve_keypair()[0].decode() for _ in range(3)]
    for who, key in zip(ids(3), keys, strict=True):
        hello(tracker, who, 0, latest=0, now=0.0, key=key)
    plan = hello(tracker, ids(3)[2], 1, latest=1, now=1.0, key=keys[2])
    assert [s.key for s in plan.sources[0]] == [keys[1], keys[0]]  # parent, grandparent
    assert set(plan.admit) == set(keys)  # a small fleet: every member may ask every member
    encoded = wire.encode(plan)
    assert wire.decode(encoded, expect=(PeerPlan,)) == plan


def test_bounds_and_bad_hellos() -> None:
    tracker = Tracker(TrackerLimits(fanout=4, max_members=2), PUB, 1.0)
    hello(tracker, b"member-0", 0, latest=0, now=0.0)
    hello(tracker, b"member-1", 0, latest=0, now=0.0)
    with pytest.raises(ProtocolError, match="max_members"):
        hello(tracker, b"member-2", 0, latest=0, now=0.0)
    with pytest.raises(ProtocolError, match="publisher instance"):
        tracker.hello(b"x", PeerHello(req=1, publisher_id="q" * 32, endpoint="tcp://1.2.3.4:5"),
                      None, None, 0.0, 0)
    with pytest.raises(ProtocolError, match="no port"):
        advertised_endpoint("tcp://1.2.3.4:0", None)
    with pytest.raises(ProtocolError, match="wildcard"):
        advertised_endpoint("tcp://0.0.0.0:5", None)
    assert advertised_endpoint("tcp://*:5", "10.1.2.3") == "tcp://10.1.2.3:5"
    assert advertised_endpoint("tcp://10.9.9.9:5", "10.1.2.3") == "tcp://10.9.9.9:5"
    with pytest.raises(ValueError, match="fanout"):
        TrackerLimits(fanout=MAX_STRIPES + 1)
    with pytest.raises(ProtocolError, match="sources"):  # a plan must have one chain a stripe
        wire.decode(wire.encode(PeerPlan(req=1, publisher_id=PUB, started_at=1.0, version=1,
                                         epoch=1, stripes=0)).replace(
            b"\xa7stripes\x00", b"\xa7stripes\x01"), expect=(PeerPlan,))


def test_plaintext_members_per_address_are_bounded_curve_members_are_not() -> None:
    """Issue 28 item 6: one host cannot fill the plan with plaintext members (sybils).

    The bound counts the address the publisher sees a member connect from, not the
    endpoint it advertises (its own choice); one member too many gets an empty plan
    (the publisher serves it) and is let in once a member of that address is gone.
    """
    tracker = Tracker(TrackerLimits(fanout=4, member_ttl=4.0), PUB, 1.0)
    assert tracker.limits.max_members_per_address == 4
    for i in range(6):  # the same host, any advertised endpoint
        hello(tracker, f"sybil-{i}".encode(), 0, latest=0, now=0.0, address="10.6.6.6",
              port=30000 + i)
    assert tracker.members() == 4 and tracker.refused_address == 2
    extra = hello(tracker, b"sybil-5", 0, latest=0, now=0.1, address="10.6.6.6", port=30005)
    assert extra.stripes == 0 and extra.slot == -1  # no place: the publisher serves it
    honest = hello(tracker, b"member-1", 0, latest=0, now=0.2, address="10.0.0.1")
    assert honest.stripes == 4 and tracker.members() == 5  # another host is not crowded out
    keys = [zmq.curve_keypair()[0].decode() for _ in range(6)]
    for i, key in enumerate(keys):  # authenticated members are counted by key, not address
        hello(tracker, f"keyed-{i}".encode(), 0, latest=0, now=0.3, address="10.6.6.6",
              port=31000 + i, key=key)
    assert tracker.members() == 11
    for i in range(4):  # the host's members go silent, and one more of it may join
        if i:
            hello(tracker, f"sybil-{i}".encode(), 0, latest=0, now=0.3, address="10.6.6.6",
                  port=30000 + i)
    hello(tracker, b"member-1", 0, latest=0, now=4.1, address="10.0.0.1")  # sybil-0 expired
    assert hello(tracker, b"sybil-5", 0, latest=0, now=4.15, address="10.6.6.6",
                 port=30005).stripes == 4
    with pytest.raises(ValueError, match="max_members_per_address"):
        TrackerLimits(max_members_per_address=-1)


def test_members_are_planned_per_slice_plan_and_only_handed_peers_of_their_own() -> None:
    """Issue 30: two slice plans and whole-version members, one tracker: each group has
    trees of its own; a member alone on its plan gets the publisher and ``other_plans``."""
    tracker = Tracker(TrackerLimits(fanout=2, max_members_per_address=0), PUB, 1.0)
    a, b = "a" * 32, "b" * 32
    digests = {0: a, 1: a, 2: a, 3: b, 4: "", 5: ""}
    members = ids(6)
    for who, digest in zip(members, digests.values(), strict=True):
        hello(tracker, who, 1, latest=1, now=0.0, plan=digest)
    answers = {i: hello(tracker, who, 2, latest=2, now=0.1, plan=digests[i])
               for i, who in enumerate(members)}
    endpoint_plan = {f"tcp://10.0.0.9:{20000 + i}": d for i, d in digests.items()}
    for i, answer in answers.items():
        named = [source for chain in answer.sources for source in chain]
        assert all(endpoint_plan[s.endpoint] == digests[i] == s.plan for s in named), i
        group = sum(1 for d in digests.values() if d == digests[i])
        assert answer.other_plans == 6 - group, i
        assert answer.slot < group and answer.stripes == min(2, group), i
    assert [s for chain in answers[3].sources for s in chain] == []  # alone: the publisher
    assert any(answers[2].sources)  # a third member of plan a fetches from the other two
    assert tracker.plan_for(a) is not None and len(tracker.plan.slots) == 2
    # the plaintext bound per address counts per plan: one host's TP=8 replica is 8
    # members, one per plan (the bound of 4 here would refuse half of it otherwise)
    bounded = Tracker(TrackerLimits(fanout=2), PUB, 1.0)
    answers8 = [hello(bounded, f"rank-{r}".encode(), 0, latest=0, now=0.0,
                      address="10.1.1.1", plan=f"{r:032x}") for r in range(8)]
    assert bounded.members() == 8 and bounded.refused_address == 0
    assert all(answer.slot == 0 for answer in answers8)
    for i in range(5):
        hello(bounded, f"again-{i}".encode(), 0, latest=0, now=0.0, address="10.1.1.1",
              port=40000 + i, plan=f"{0:032x}")
    assert bounded.refused_address == 2  # 4 of plan 0 from this address: one more refused
    # a member whose plan changes leaves its group (skipped at once, gone at the next
    # version); a plan nobody holds any more is forgotten
    hello(tracker, members[3], 2, latest=2, now=0.2, plan=a)
    assert hello(tracker, members[2], 2, latest=2, now=0.3, plan=a).other_plans == 2
    hello(tracker, members[3], 3, latest=3, now=0.5, plan=a)
    assert len(tracker.plan_for(a).slots) == 4  # type: ignore[union-attr]
    assert tracker.plan_for(b) is None
    with pytest.raises(msgspec.ValidationError, match="plan"):
        msgspec.convert({"t": "peer_hello", "req": 1, "publisher_id": PUB, "endpoint": "x",
                         "plan": "Z" * 32}, PeerHello)
