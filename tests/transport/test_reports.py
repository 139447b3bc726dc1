"""The back-channel: reports bound to their sender's key, bounded, never a fake quorum
(under CURVE a quorum counts keys; without it, the first wait says anyone can fake one)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import zmq

from publisher import WeightPublisher, WeightPubTimeout
from publisher.serving.reports import UNAUTHENTICATED_QUORUM, ReportLimits, ReportTable
from publisher.serving.server import ServerLimits
from subscriber_ext import WeightSubscriber
from tests.transport.faults.tools import RawPeer, rss_mib
from tests.transport.procs import wait_until
from weightpub_wire import protocol as wire
from weightpub_wire.keys import create_key_pair

pytestmark = pytest.mark.timeout(90)
TOP = (1 << 63) - 1


def _report(sub_id: str, version: int, publisher_id: str | None, error: str | None = None
            ) -> wire.Report:
    return wire.Report(subscriber_id=sub_id, staged_version=version, applied_version=version,
                       last_error=error, publisher_id=publisher_id)


def test_with_curve_a_stranger_cannot_overwrite_rows_or_fake_a_quorum(
    tmp_path, make_sub: Callable[..., WeightSubscriber],
) -> None:
    public, secret = create_key_pair(tmp_path, "server")
    server_key = zmq.auth.load_certificate(str(public))[0]
    with WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(secret),
                         heartbeat_interval=0.2) as pub:
        sub = make_sub(pub.endpoint, curve_server_key_file=str(public), subscriber_id="real",
                       report_interval=0.2)
        version = pub.publish({"w": torch.arange(10)})
        sub.wait_for_version(version, timeout=20)
        sub.mark_applied(version)
        pub.wait_for_subscribers(version, 1, timeout=20)
        ctx = zmq.Context()
        stranger = RawPeer(ctx, pub.endpoint, server_key=server_key)
        try:
            stranger.send(_report("real", TOP, pub.publisher_id, "owned"))  # same id as real
            for i in range(5):
                stranger.send(_report(f"fake-{i}", TOP, pub.publisher_id))
            assert isinstance(stranger.call(wire.StatusRequest(req=1)), wire.StatusReply)
        finally:
            stranger.close()
            ctx.destroy(linger=0)
        fleet = pub.fleet()
        real = [r for r in fleet if r.subscriber_id == "real" and r.last_error is None]
        assert len(real) == 1 and real[0].applied_version == version
        keys = {r.client_key for r in fleet}
        assert len(keys) == 2 and None not in keys  # the real key and the stranger's
        # the forged 2**63-1 rows are visible but never count as a quorum
        with pytest.raises(WeightPubTimeout, match="1/2 subscribers"):
            pub.wait_for_subscribers(version, 2, timeout=1)
        assert len(pub.wait_for_subscribers(version, 1, timeout=5)) == 1


def test_without_curve_forged_versions_and_other_instances_do_not_count(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    pub = make_pub()
    version = pub.publish({"w": torch.arange(3)})
    pub.wait_announced(version, timeout=20)
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        peer.send(_report("a", TOP, pub.publisher_id))  # beyond anything announced
        peer.send(_report("b", version, "another-instance"))  # not this instance
        peer.send(_report("c", version, None))  # no instance named
        peer.call(wire.StatusRequest(req=1))
    finally:
        peer.close()
        ctx.destroy(linger=0)
    assert {r.subscriber_id for r in pub.fleet()} == {"a", "b", "c"}
    with pytest.raises(WeightPubTimeout):
        pub.wait_for_subscribers(version, 1, timeout=0.5)


def test_report_table_and_status_replies_are_bounded(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    limits = ServerLimits(reports=ReportLimits(max_reports=300, max_reports_per_client=50,
                                               max_status_rows=100))
    pub = make_pub(limits=limits)
    version = pub.publish({"w": torch.arange(1000)})
    pub.wait_announced(version, timeout=20)
    ctx = zmq.Context()
    before = rss_mib()
    peers = []
    try:
        big = "e" * wire.MAX_ERROR_CHARS
        for p in range(10):  # 10 connections, 200 max-size reports each: 2,000 rows offered
            peer = RawPeer(ctx, pub.endpoint)
            peers.append(peer)
            for i in range(200):
                peer.send(_report(f"p{p}-{i}", 1, None, big))
        wait_until(lambda: pub._server.refused_reports >= 2000 - 50, 30, "every report read")
        status = peers[0].call(wire.StatusRequest(req=1), timeout=30)
        assert isinstance(status, wire.StatusReply)
        # no CURVE and one address: every connection is the same client
        assert len(pub.fleet()) == 50 and len(status.subscribers) == 50
        assert all(len(r.last_error or "") <= 1024 for r in status.subscribers)
        # twenty status requests nobody reads: what the publisher queues for that peer is
        # bounded by its credit, and the service goes on
        lazy = RawPeer(ctx, pub.endpoint, rcvhwm=1)
        peers.append(lazy)
        for i in range(20):
            lazy.send(wire.StatusRequest(req=i))
        with WeightSubscriber(pub.endpoint) as sub:
            new = pub.publish({"w": torch.arange(1000) * 2})
            assert torch.equal(sub.wait_for_version(new, timeout=20).tensors["w"],
                               torch.arange(1000) * 2)
        grown = rss_mib() - before
        print(f"\nreports: 2000 max-size offered, {len(pub.fleet())} kept; RSS {before:.0f} -> "
              f"{before + grown:.0f} MiB")
        assert grown < 100, grown
    finally:
        for peer in peers:
            peer.close()
        ctx.destroy(linger=0)


def test_a_long_subscriber_error_is_cut_and_its_reports_still_arrive(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub()
    sub = make_sub(pub.endpoint, subscriber_id="chatty", report_interval=0.2)
    version = pub.publish({"w": torch.arange(4)})
    sub.wait_for_version(version, timeout=20)
    sub.mark_applied(0, "x" * 50_000)  # an apply error far over the wire's 4,096 characters
    sub.mark_applied(version)
    row = wait_until(lambda: [r for r in pub.fleet() if r.subscriber_id == "chatty"
                              and r.applied_version == version and r.last_error], 20,
                     "the report with the long error")[0]
    assert row.last_error.startswith("ApplyError: xxx")
    assert len(row.last_error) == wire.MAX_ERROR_CHARS
    assert len(sub.status()["last_error"]) == wire.MAX_ERROR_CHARS
    assert pub._server.bad_messages == 0
    pub.wait_for_subscribers(version, 1, timeout=10)


def test_under_curve_one_allow_listed_key_on_five_connections_is_one_reporter(
    tmp_path, make_sub: Callable[..., WeightSubscriber],
) -> None:
    """Issue 22.4: a holder of an allow-listed key, over five connections, files ghost rows
    and a report under the real subscriber's id: the real row stays the real one, and the
    quorum counts keys (real + ghost holder = 2), not the six ids."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    public, secret = create_key_pair(tmp_path, "server")
    _, real_secret = create_key_pair(allowed, "real")
    _, ghost_secret = create_key_pair(allowed, "ghost")
    server_key = zmq.auth.load_certificate(str(public))[0]
    ghost_pair = zmq.auth.load_certificate(str(ghost_secret))
    assert ghost_pair[1] is not None
    with WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(secret),
                         curve_allowed_clients_dir=str(allowed), heartbeat_interval=0.2) as pub:
        sub = make_sub(pub.endpoint, curve_server_key_file=str(public),
                       curve_secret_key_file=str(real_secret), subscriber_id="real",
                       report_interval=0.2)
        version = pub.publish({"w": torch.arange(10)})
        sub.wait_for_version(version, timeout=20)
        sub.mark_applied(version)
        real_key = pub.wait_for_subscribers(version, 1, timeout=20)[0].client_key
        ctx = zmq.Context()
        ghosts = [RawPeer(ctx, pub.endpoint, server_key=server_key,
                          keypair=(ghost_pair[0], ghost_pair[1])) for _ in range(5)]
        try:
            for i, ghost in enumerate(ghosts):
                ghost.send(_report("real", version, pub.publisher_id, "owned"))
                ghost.send(_report(f"ghost-{i}", version, pub.publisher_id))
            for ghost in ghosts:  # a reply on each connection: its reports were read
                assert isinstance(ghost.call(wire.StatusRequest(req=1)), wire.StatusReply)
        finally:
            for ghost in ghosts:
                ghost.close()
            ctx.destroy(linger=0)
        fleet = pub.fleet()
        assert {r.subscriber_id for r in fleet} == {"real", *(f"ghost-{i}" for i in range(5))}
        real = [r for r in fleet if r.subscriber_id == "real"]
        assert len(real) == 1 and real[0].client_key == real_key and real[0].last_error is None
        assert pub._server.refused_reports >= 5  # "real" from another key: refused each time
        ghost_keys = {r.client_key for r in fleet if r.subscriber_id != "real"}
        assert len(ghost_keys) == 1 and real_key not in ghost_keys
        with pytest.raises(WeightPubTimeout, match="2/3 subscribers"):
            pub.wait_for_subscribers(version, 3, timeout=1)
        assert len(pub.wait_for_subscribers(version, 2, timeout=5)) == 6  # two keys, six rows
        # a fleet sharing one key may count ids instead, knowingly
        assert len(pub.wait_for_subscribers(version, 6, timeout=5, distinct_keys=False)) == 6


def test_a_subscriber_id_belongs_to_its_first_key_until_its_row_expires() -> None:
    table = ReportTable(ReportLimits(ttl=30.0))
    first = _report("node", 3, "p")
    assert table.record(first, "key-a", 100.0, "key-a") is None
    refused = table.record(_report("node", 9, "p", "mine now"), "key-b", 110.0, "key-b")
    assert refused is not None and "another CURVE key" in refused
    assert [(r.client_key, r.applied_version) for r in table.live(120.0)] == [("key-a", 3)]
    assert table.record(_report("node", 4, "p"), "key-a", 120.0, "key-a") is None  # its own
    # the owner stops reporting: once its row has expired the id is free again
    assert table.record(_report("node", 9, "p"), "key-b", 151.0, "key-b") is None
    assert [(r.client_key, r.applied_version) for r in table.live(152.0)] == [("key-b", 9)]


def test_without_curve_ghost_ids_satisfy_a_quorum_and_the_first_wait_says_so(
    make_pub: Callable[..., WeightPublisher], caplog: pytest.LogCaptureFixture,
) -> None:
    """What plain TCP cannot prevent, said where it matters: five invented ids from one
    stranger are a quorum of five, and the first wait_for_subscribers warns (once)."""
    pub = make_pub()
    version = pub.publish({"w": torch.arange(3)})
    pub.wait_announced(version, timeout=20)
    assert "any host" in (WeightPublisher.wait_for_subscribers.__doc__ or "")
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        for i in range(5):
            peer.send(_report(f"ghost-{i}", version, pub.publisher_id))
        peer.call(wire.StatusRequest(req=1))
    finally:
        peer.close()
        ctx.destroy(linger=0)
    with caplog.at_level(logging.WARNING, logger="weightpub.publisher"):
        assert len(pub.wait_for_subscribers(version, 5, timeout=5)) == 5
        pub.wait_for_subscribers(version, 1, timeout=5)
    warned = [r for r in caplog.records if UNAUTHENTICATED_QUORUM in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
