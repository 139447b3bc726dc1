"""``weightpub status`` prints what strangers reported without letting it act on the terminal."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import zmq

from publisher import WeightPublisher
from publisher.sharding.shard_coordinator import ShardCoordinator
from tests.transport.faults.tools import RawPeer
from tests.transport.test_sharded import _submit
from weightpub.cli import main as cli_main
from weightpub.fleet_view import printable
from weightpub.status import fetch_status
from weightpub_wire import protocol as wire

pytestmark = pytest.mark.timeout(60)

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b1m\r\x08\u202egnp.exe\u2066"


def test_printable_replaces_every_control_and_format_character() -> None:
    out = printable(ESCAPES, limit=1000).plain
    assert out.isprintable()
    for char in ("\x1b", "\x07", "\x9b", "\r", "\x08", "\u202e", "\u2066"):
        assert char not in out
    assert "pwned" in out and "\ufffd" in out
    assert printable("plain text, ünïcode ok").plain == "plain text, ünïcode ok"


def test_status_command_sanitizes_peer_text(
    make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str],
) -> None:
    pub = make_pub()
    pub.wait_announced(pub.publish({"w": torch.arange(3)}), timeout=20)
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        # names are refused on the wire if they hold C0/C1 controls; format characters pass
        peer.send(wire.Report(subscriber_id="evil\u202eexe.txt", staged_version=1,
                              applied_version=1, last_error=ESCAPES))
        peer.call(wire.StatusRequest(req=1))
    finally:
        peer.close()
        ctx.destroy(linger=0)
    assert cli_main(["status", pub.endpoint]) == 0
    out = capsys.readouterr().out
    assert "evil" in out and "\ufffd" in out
    assert not any(c in out for c in ("\x1b", "\x07", "\x9b", "\r", "\x08", "\u202e", "\u2066"))
    assert cli_main(["status", pub.endpoint, "--json"]) == 0
    raw = capsys.readouterr().out
    assert raw.isascii()  # every control and format character escaped
    assert json.loads(raw)["subscribers"][0]["last_error"] == ESCAPES


def test_status_shows_host_memory_and_a_shard_groups_missing_ranks(
    make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str],
) -> None:
    pub = make_pub()
    pub.wait_announced(pub.publish({"w": torch.zeros(1 << 18)}), timeout=20)  # 1 MiB
    reply = fetch_status(pub.endpoint)
    assert reply.memory is not None and reply.memory.keep_versions == 1
    assert reply.memory.held_bytes >= 1 << 20 and reply.memory.budget_bytes > 0
    assert reply.shard_group is None
    assert cli_main(["status", pub.endpoint]) == 0
    assert "keep_versions 1" in capsys.readouterr().out

    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 3) as coord:
        coord.submitted(_submit(1, 7, world=3), time.monotonic())  # ranks 0 and 2 missing
        coord.submitted(_submit(0, 5, world=2), time.monotonic())  # refused: wrong group
        group = fetch_status(coord.endpoint).shard_group
        assert group is not None and group.world_size == 3 and group.refused_submits == 1
        assert [(p.version, p.ranks_in) for p in group.pending] == [(7, (1,))]
        assert cli_main(["status", coord.endpoint]) == 0
        out = capsys.readouterr().out
    assert "sharded over 3 trainer ranks" in out and "version 7 waits" in out
    assert "for ranks 0, 2" in out and "1 submit(s) refused" in out


def test_reports_carry_each_ranks_received_share_bounded_and_old_reports_still_parse(
    make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str],
) -> None:
    """A sliced rank reports the share of its applied version it received (issue 30);
    the trainer's fleet view shows it per replica rank. A report without the field (an
    older subscriber) is filed as before; a bad share (NaN, negative, beyond the bound)
    is dropped and counted, and the publisher goes on serving."""
    import msgspec

    pub = make_pub()
    version = pub.publish({"w": torch.arange(3)})
    pub.wait_announced(version, timeout=20)
    fields = {"t": "report", "p": wire.PROTOCOL_VERSION, "staged_version": version,
              "applied_version": version, "publisher_id": pub.publisher_id}
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        for rank, share in ((0, 0.5213), (1, 0.5388)):
            peer.send(wire.Report(subscriber_id=f"host-rank{rank}", staged_version=version,
                                  applied_version=version, publisher_id=pub.publisher_id,
                                  ranks=(rank,), data_path="slices", received_fraction=share))
        peer.send(msgspec.msgpack.encode({**fields, "subscriber_id": "old-node",
                                          "ranks": [0, 1]}))  # no received_fraction
        before = pub._server.bad_messages
        bad = (float("nan"), -0.5, wire.MAX_RECEIVED_FRACTION * 2, "half")
        for share in bad:
            peer.send(msgspec.msgpack.encode({**fields, "subscriber_id": "liar",
                                              "received_fraction": share}))
        status = peer.call(wire.StatusRequest(req=1))  # handled in order: all seen
    finally:
        peer.close()
        ctx.destroy(linger=0)
    assert isinstance(status, wire.StatusReply)
    assert pub._server.bad_messages - before == len(bad)
    rows = {r.subscriber_id: r for r in pub.fleet()}
    assert sorted(rows) == ["host-rank0", "host-rank1", "old-node"]
    assert rows["host-rank0"].received_fraction == 0.5213 and rows["host-rank1"].ranks == (1,)
    assert rows["old-node"].received_fraction is None and rows["old-node"].ranks == (0, 1)
    assert cli_main(["status", pub.endpoint]) == 0
    out = capsys.readouterr().out
    assert "received" in out and "0.52x" in out and "0.54x" in out
    assert cli_main(["status", pub.endpoint, "--json"]) == 0
    shares = {r["subscriber_id"]: r["received_fraction"]
              for r in json.loads(capsys.readouterr().out)["subscribers"]}
    assert shares == {"host-rank0": 0.5213, "host-rank1": 0.5388, "old-node": None}


@dataclass(frozen=True)
class PeerKind:
    """One kind of a member's peer counters in its report, as this file checks it."""

    field: str  # the Report's (and StatusReply's) field
    served: wire.PeerFigures  # what member0 reports
    read: wire.PeerFigures  # what member1 reports
    gave: str  # a count of what the member gave peers
    total: wire.PeerFigures  # the two summed
    totals: str  # the WeightPublisher's method that sums them
    gauges: dict[str, int]  # weightpub_publisher_fleet_<name> -> value
    line: str  # in weightpub status


PEER_KINDS = [
    PeerKind("peer_nixl", wire.PeerNixlFigures(offers=3, unoffered=(("frames", 1),)),
             wire.PeerNixlFigures(bytes_from_peers=5 << 20, chunks_from_peers=20,
                                  unoffered=(("budget", 2), ("frames", 1))), "offers",
             wire.PeerNixlFigures(bytes_from_peers=5 << 20, chunks_from_peers=20, offers=3,
                                  unoffered=(("budget", 2), ("frames", 2))),
             "peer_nixl_totals", {"nixl_bytes_from_peers": 5 << 20, "peer_nixl_offers": 3},
             "peers over nixl: 5.0 MiB in 20 chunk(s) READ from peers, 3 offer(s)"),
    PeerKind("peer_stream", wire.PeerStreamFigures(bytes_served=5 << 20, chunks_served=20,
                                                   fallbacks=(("closed", 1),)),
             wire.PeerStreamFigures(bytes_from_peers=5 << 20, chunks_from_peers=20,
                                    fallbacks=(("budget", 2), ("closed", 1))), "bytes_served",
             wire.PeerStreamFigures(bytes_from_peers=5 << 20, chunks_from_peers=20,
                                    bytes_served=5 << 20, chunks_served=20,
                                    fallbacks=(("budget", 2), ("closed", 2))),
             "peer_stream_totals", {"stream_bytes_from_peers": 5 << 20,
                                    "peer_stream_sent_chunks": 20},
             "peers over the stream: 5.0 MiB in 20 chunk(s) from peers, 5.0 MiB in 20 "
             "chunk(s) served"),
]


@pytest.mark.parametrize("kind", PEER_KINDS, ids=lambda kind: kind.field)
def test_reports_carry_peer_counters_bounded_and_old_and_new_sides_still_parse(
    make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str],
    kind: PeerKind,
) -> None:
    """A member's peers-over-NIXL (issue 31) or over-the-stream counters ride in its
    report; the publisher sums them over the fleet (status reply, ``peer_*_totals``,
    /metrics) and shows each row's. A report without them (an older subscriber) is filed
    as before, and an older publisher's ``Report`` drops the unknown field; a bad value
    (negative, NaN, past 2**63 - 1, 17 causes, a cause named twice or not a plain word)
    is refused naming the field, counted, and the publisher goes on serving."""
    import msgspec

    from publisher.publisher_metrics import PublisherCollector

    pub = make_pub()
    version = pub.publish({"w": torch.arange(3)})
    pub.wait_announced(version, timeout=20)
    fields = {"t": "report", "p": wire.PROTOCOL_VERSION, "staged_version": version,
              "applied_version": version, "publisher_id": pub.publisher_id}
    causes = kind.total.CAUSES
    bad = {"bytes_from_peers": -1, kind.gave: float("nan"), "chunks_from_peers": 1 << 63,
           causes: [[f"c{i}", 1] for i in range(17)]}
    cases = [({name: value}, name) for name, value in bad.items()] + \
        [({causes: value}, causes) for value in ([["frames", 1], ["frames", 2]],
                                                 [["Bad cause", 1]])]
    for figures, name in cases:  # each refused naming its field
        with pytest.raises(wire.ProtocolError, match=rf"report\.{kind.field}\.{name}"):
            wire.decode(msgspec.msgpack.encode({**fields, "subscriber_id": "liar",
                                                kind.field: figures}))
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        for name, member in (("member0", kind.served), ("member1", kind.read)):
            peer.send(msgspec.structs.replace(wire.Report(
                subscriber_id=name, staged_version=version, applied_version=version,
                publisher_id=pub.publisher_id), **{kind.field: member}))
        peer.send(msgspec.msgpack.encode({**fields, "subscriber_id": "old-node"}))
        before = pub._server.bad_messages
        for figures, _ in cases:
            peer.send(msgspec.msgpack.encode({**fields, "subscriber_id": "liar",
                                              kind.field: figures}))
        status = peer.call(wire.StatusRequest(req=1))  # handled in order: all seen
    finally:
        peer.close()
        ctx.destroy(linger=0)
    assert isinstance(status, wire.StatusReply)
    assert pub._server.bad_messages - before == len(cases)
    rows = {r.subscriber_id: r for r in pub.fleet()}
    assert sorted(rows) == ["member0", "member1", "old-node"]
    assert getattr(rows["member1"], kind.field) == kind.read
    assert getattr(rows["old-node"], kind.field) is None
    assert getattr(status, kind.field) == kind.total == getattr(pub, kind.totals)()

    class OldReport(msgspec.Struct, tag_field="t", tag="report", kw_only=True):
        """A publisher's ``Report`` before the field: unknown fields are dropped."""

        subscriber_id: str
        staged_version: int
        applied_version: int
        p: int = wire.PROTOCOL_VERSION

    new = wire.encode(rows["member1"])
    assert msgspec.msgpack.decode(new, type=OldReport).subscriber_id == "member1"
    metrics = {m.name.removeprefix("weightpub_publisher_fleet_"): m.samples
               for m in PublisherCollector(pub._figures).collect()}
    assert {name: metrics[name][0].value for name in kind.gauges} == kind.gauges
    cause_gauge = next(name for name in metrics if name.endswith(causes))
    assert {s.labels["cause"]: s.value for s in metrics[cause_gauge]} == \
        dict(kind.total.causes())
    assert cli_main(["status", pub.endpoint]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert kind.line in out
    shown = ", ".join(f"{cause}={count}" for cause, count in kind.total.causes())
    assert f"{causes}: {shown}" in out and "5.0M" in out  # member1's row
    assert cli_main(["status", pub.endpoint, "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply[kind.field][kind.gave] == getattr(kind.total, kind.gave)
