"""Who the publisher puts in its group, and when it re-forms it (``MemberTable``, no sockets).

The rules under test: a subscriber is planned in only while it polls and says
its receiver is free; a member that goes silent or leaves its epoch triggers a
re-form; simultaneous joiners form once; after a teardown the next epoch waits
briefly for the old members and never for a dead one; a member that misses a
rendezvous the others made is penalized; every row is bounded.
"""

from __future__ import annotations

import pytest

from publisher.collective.collective_members import MemberLimits, MemberTable
from weightpub_wire import protocol as wire
from weightpub_wire.collective_layout import RoundHeader, bucket_spans

pytestmark = pytest.mark.timeout(30)
LIMITS = MemberLimits(member_ttl=3.0, join_delay=0.3, regroup=1.5, max_members=8,
                      max_rows_per_client=3)


def poll(table: MemberTable, name: str, now: float, state: str = "free", epoch: int = 0,
         client: str = "addr:1", backend: str = "gloo") -> wire.CollectiveReply:
    request = wire.CollectivePoll(req=1, subscriber_id=name, state=state, epoch=epoch,
                                  backend=backend)
    return table.poll(client, request, now, publisher_id="pub", started_at=1.0)


def test_a_free_subscriber_is_planned_in_after_the_join_delay():
    table = MemberTable("gloo", LIMITS)
    assert poll(table, "a", 10.0).state == "waiting"
    assert not table.reform_due(10.1)  # simultaneous joiners get a moment to arrive
    poll(table, "b", 10.2)
    assert table.reform_due(10.35)
    plan = table.new_plan(10.35)
    assert plan is not None and plan.members == (("addr:1", "a"), ("addr:1", "b"))
    reply = poll(table, "b", 10.4)
    assert (reply.state, reply.epoch, reply.rank, reply.world_size) == ("forming", 1, 2, 3)
    table.activate()
    assert poll(table, "a", 10.5, "member", 1).state == "active"
    assert not table.reform_due(10.6)


def active_group(table: MemberTable, names: list[str], now: float) -> None:
    for name in names:
        poll(table, name, now)
    assert table.reform_due(now + LIMITS.join_delay)
    assert table.new_plan(now + LIMITS.join_delay) is not None
    table.activate()
    for name in names:
        poll(table, name, now + 0.5, "member", table.epoch)


def test_a_silent_member_or_one_that_left_its_epoch_triggers_a_re_form():
    table = MemberTable("gloo", LIMITS)
    active_group(table, ["a", "b"], 10.0)
    poll(table, "a", 12.0, "member", 1)
    assert not table.reform_due(12.0)
    assert table.reform_due(13.6)  # b silent for more than member_ttl
    table2 = MemberTable("gloo", LIMITS)
    active_group(table2, ["a", "b"], 10.0)
    poll(table2, "b", 11.0, "free", 1)  # b's receiver left epoch 1
    assert table2.reform_due(11.0)
    poll(table2, "c", 11.0)  # a newcomer: re-form once it waited the join delay
    table3 = MemberTable("gloo", LIMITS)
    active_group(table3, ["a"], 10.0)
    poll(table3, "c", 11.0)
    assert not table3.reform_due(11.1) and table3.reform_due(11.4)


def test_after_a_teardown_the_next_epoch_waits_for_live_members_but_not_for_dead_ones():
    table = MemberTable("gloo", LIMITS)
    active_group(table, ["a", "b"], 10.0)
    table.end_plan(11.0)  # e.g. b was killed mid-broadcast
    poll(table, "a", 10.9, "member", 1)  # a poll sent before the teardown does not count
    assert not table.reform_due(11.1)
    poll(table, "a", 11.2, "free", 1)
    assert not table.reform_due(11.6)  # b polled 1.5 s ago: maybe alive, wait for it
    assert table.reform_due(12.6)  # regroup window over: go without b
    plan = table.new_plan(12.6)
    assert plan is not None and [k[1] for k in plan.members] == ["a"]


def test_a_member_that_missed_the_rendezvous_is_penalized():
    table = MemberTable("gloo", LIMITS)
    for name in ("a", "b"):
        poll(table, name, 10.0)
    plan = table.new_plan(10.5)
    assert plan is not None
    table.end_plan(11.0, arrived=[0, 1])  # rank 2 (b) never arrived
    assert poll(table, "b", 11.1).state == "refused"
    poll(table, "a", 11.1)
    assert table.reform_due(11.5)
    plan = table.new_plan(11.5)
    assert plan is not None and [k[1] for k in plan.members] == ["a"]
    assert poll(table, "b", 13.2).state == "waiting"  # penalty (2 s) over


def test_polls_are_bounded_and_checked():
    table = MemberTable("gloo", LIMITS)
    for index in range(3):
        assert poll(table, f"s{index}", 1.0).state == "waiting"
    refused = poll(table, "s3", 1.0)
    assert refused.state == "refused" and "3 subscribers" in refused.reason
    assert poll(table, "other", 1.0, client="addr:2").state == "waiting"
    wrong = poll(table, "x", 1.0, client="addr:3", backend="nccl")
    assert wrong.state == "refused" and "serves gloo" in wrong.reason
    gone = poll(table, "s0", 1.1, "leaving")
    assert gone.state == "idle" and poll(table, "s3", 1.2).state == "waiting"
    ipc = MemberTable("cuda_ipc", LIMITS, device_uuid="GPU-a")
    other_gpu = poll(ipc, "x", 1.0, backend="cuda_ipc")
    assert other_gpu.state == "refused" and "publisher's GPU" in other_gpu.reason


def test_round_headers_are_checked_against_what_the_member_agreed_to():
    header = RoundHeader(kind=1, epoch=3, version=7, total_bytes=10_000, bucket_bytes=4096,
                         buckets=3, publisher=99)
    words = header.to_tensor()
    assert RoundHeader.from_tensor(words, epoch=3, publisher=99, max_total_bytes=1 << 20,
                                   bucket_bytes=4096) == header
    for kwargs, problem in (({"epoch": 4}, "epoch"), ({"publisher": 98}, "epoch"),
                            ({"max_total_bytes": 9999}, "out of bounds"),
                            ({"bucket_bytes": 8192}, "announced")):
        checks = {"epoch": 3, "publisher": 99, "max_total_bytes": 1 << 20,
                  "bucket_bytes": 4096, **kwargs}
        with pytest.raises(ValueError, match=problem):
            RoundHeader.from_tensor(words, **checks)
    bad = words.clone()
    bad[6] = 2  # buckets that do not cut the version
    with pytest.raises(ValueError, match="do not cut"):
        RoundHeader.from_tensor(bad, epoch=3, publisher=99, max_total_bytes=1 << 20,
                                bucket_bytes=4096)
    bad[0] = 0
    with pytest.raises(ValueError, match="magic"):
        RoundHeader.from_tensor(bad, epoch=3, publisher=99, max_total_bytes=1 << 20,
                                bucket_bytes=4096)
    assert bucket_spans(10_000, 4096) == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert bucket_spans(0, 4096) == []
