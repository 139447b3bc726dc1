"""CURVE on the sharded path: one trainer key pair serves the coordinator and every rank.

Every rank is a ``ShardedPublisher`` with the same ``curve_secret_key_file``; the
subscriber's ``curve_server_key_file`` (the trainer's public key) authenticates the
coordinator and each rank, and every one of them admits only its allow-listed
subscribers. The collect socket admits only the trainer's own key: an
allow-listed subscriber key, a stranger's key or a plaintext DEALER cannot
submit a shard. Peer-sharing members authenticate each other with the keys the
coordinator's tracker saw. Ranks run in this process (real sockets, one context each).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from publisher.sharded_publisher import ShardedPublisher
from publisher.sharding.shard_coordinator import ShardCoordinator
from subscriber_ext import WeightSubscriber
from tests.transport.procs import as_bytes, det_weights, wait_until
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError, WeightPubTimeout
from weightpub_wire.keys import create_key_pair
from weightpub_wire.security import load_key_file
from weightpub_wire.shard_submit import ShardSubmit, encode_submit

pytestmark = pytest.mark.timeout(60)

CHUNK = 4096
SPECS = [[("a.w", "float32", (300, 17)), ("a.b", "bfloat16", (17,))],
         [("b.w", "float32", (200, 33)), ("b.h", "int32", (5,))]]
SEED = 21


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    public, secret = create_key_pair(tmp_path, "trainer")
    _, replica = create_key_pair(allowed, "replica")
    create_key_pair(other, "someone-else")
    _, stranger = create_key_pair(tmp_path, "stranger")
    return {"public": str(public), "secret": str(secret), "allowed": str(allowed),
            "other": str(other), "replica": str(replica), "stranger": str(stranger)}


@contextmanager
def _ranks(keys: dict[str, Any], allowed: list[str]) -> Iterator[list[ShardedPublisher]]:
    """Two CURVE ranks; rank r admits the subscribers in ``allowed[r]``."""
    rank0 = ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                             coordinator="tcp://127.0.0.1:0",
                             announce_endpoint="tcp://127.0.0.1:0", chunk_size=CHUNK,
                             curve_secret_key_file=keys["secret"],
                             curve_allowed_clients_dir=allowed[0])
    try:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint,
                              chunk_size=CHUNK, curve_secret_key_file=keys["secret"],
                              curve_allowed_clients_dir=allowed[1]) as rank1:
            yield [rank0, rank1]
    finally:
        rank0.close()


def _publish(ranks: list[ShardedPublisher], version: int) -> dict[str, torch.Tensor]:
    expected: dict[str, torch.Tensor] = {}
    for pub, spec in zip(ranks, SPECS, strict=True):
        weights = det_weights(SEED, version, [(n, d, tuple(s)) for n, d, s in spec])
        pub.publish(weights, version=version)
        expected.update(weights)
    return expected


def test_a_curve_sharded_version_reaches_an_allow_listed_subscriber_bit_exact(
    keys: dict[str, Any],
) -> None:
    with _ranks(keys, [keys["allowed"], keys["allowed"]]) as ranks:
        coordinator = ranks[0].coordinator
        assert coordinator is not None
        with WeightSubscriber(coordinator.endpoint, curve_server_key_file=keys["public"],
                              curve_secret_key_file=keys["replica"],
                              request_timeout=2.0) as sub:
            for version in (1, 2):
                expected = _publish(ranks, version)
                staged = sub.wait_for_version(version, timeout=30)
                assert set(staged.tensors) == set(expected)
                for name, want in expected.items():
                    assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want)), name
            shards = staged.manifest.shards
            assert shards is not None and [s.endpoint for s in shards] == \
                [ranks[0].endpoint, ranks[1].endpoint]
            # the replica's reports reach the coordinator under its authenticated key
            public, _ = load_key_file(keys["replica"], need_secret=False)
            wait_until(lambda: any(r.client_key == public.decode()
                                   for r in coordinator.fleet()), 20, "the replica's report")
        assert coordinator.refused_handshakes == 0 and coordinator.refused_submits == 0


def test_a_subscriber_not_allow_listed_gets_nothing_from_the_coordinator_or_a_rank(
    keys: dict[str, Any],
) -> None:
    # rank 1 admits someone else: the replica reaches the coordinator and rank 0 only
    with _ranks(keys, [keys["allowed"], keys["other"]]) as ranks:
        coordinator = ranks[0].coordinator
        assert coordinator is not None
        stranger = WeightSubscriber(coordinator.endpoint, request_timeout=1.0,
                                    curve_server_key_file=keys["public"],
                                    curve_secret_key_file=keys["stranger"])
        plaintext = WeightSubscriber(coordinator.endpoint, request_timeout=1.0)
        replica = WeightSubscriber(coordinator.endpoint, request_timeout=1.0,
                                   curve_server_key_file=keys["public"],
                                   curve_secret_key_file=keys["replica"])
        try:
            _publish(ranks, 1)
            coordinator.wait_announced(1, timeout=20)
            wait_until(lambda: "refused this client's CURVE key" in
                       str(stranger.status()["last_error"]), 20, "the stranger's refusal")
            wait_until(lambda: "one side uses CURVE" in
                       str(plaintext.status()["last_error"]), 20, "the plaintext refusal")
            wait_until(lambda: "trainer rank 1's shard" in
                       str(replica.status()["last_error"]), 20, "rank 1's refusal")
            assert "refused this client's CURVE key" in str(replica.status()["last_error"])
            for sub in (stranger, plaintext, replica):
                with pytest.raises(WeightPubTimeout):
                    sub.wait_for_version(1, timeout=0.5)
                assert sub.latest() is None
            assert stranger.status()["publisher_latest_version"] == 0  # not the manifest
            assert replica.status()["publisher_latest_version"] == 1  # not rank 1's bytes
        finally:
            for sub in (stranger, plaintext, replica):
                sub.close()


def test_only_the_trainers_key_may_submit_shards(keys: dict[str, Any]) -> None:
    """An allow-listed subscriber's key, a stranger's key and a plaintext DEALER each
    send a complete version 5 of a one-rank group; none is announced, the rank's is."""
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=1,
                          coordinator="tcp://127.0.0.1:0",
                          announce_endpoint="tcp://127.0.0.1:0", chunk_size=CHUNK,
                          curve_secret_key_file=keys["secret"],
                          curve_allowed_clients_dir=keys["allowed"]) as rank0:
        coordinator = rank0.coordinator
        assert coordinator is not None
        entry = wire.TensorEntry(name="forged", dtype="uint8", shape=(CHUNK,), offset=0,
                                 nbytes=CHUNK)
        forged = encode_submit(ShardSubmit(
            rank=0, world_size=1, version=5, publisher_id="forger",
            endpoint="tcp://127.0.0.1:9", chunk_size=CHUNK, total_bytes=CHUNK,
            tensors=(entry,), checksums=(0,)))
        trainer_public, _ = load_key_file(keys["public"], need_secret=False)
        ctx = zmq.Context()
        dealers = []
        try:
            for key_file in (keys["replica"], keys["stranger"], None):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                if key_file is not None:
                    public, secret = load_key_file(key_file, need_secret=True)
                    dealer.curve_serverkey = trainer_public
                    dealer.curve_publickey = public
                    dealer.curve_secretkey = secret
                monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                dealer.connect(coordinator.collect_endpoint)
                dealer.send(forged)
                dealers.append((dealer, monitor))
            for _, monitor in dealers:  # every handshake failed, none was let through
                assert monitor.poll(20_000), "no handshake failure"
                event, _ = struct.unpack("=Hi", monitor.recv_multipart()[0])
                assert event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                 zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            assert coordinator.refused_handshakes >= 2  # the two CURVE keys, by the ZAP
            assert "is not the trainer's key" in coordinator.last_error
            assert coordinator.latest_version == 0
            weights = {"w": torch.arange(3000, dtype=torch.float32)}
            rank0.publish(weights, version=1)
            coordinator.wait_announced(1, timeout=20)
            manifest = coordinator.manifest()
            assert manifest is not None and manifest.version == 1
            assert manifest.shards is not None and manifest.shards[0].endpoint == rank0.endpoint
            assert coordinator.refused_submits == 0
        finally:
            for dealer, monitor in dealers:
                dealer.disable_monitor()
                monitor.close(linger=0)
                dealer.close(linger=0)
            ctx.term()


def test_non_loopback_binds_need_curve_or_insecure(keys: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="insecure"):
        ShardCoordinator("tcp://0.0.0.0:0", "tcp://127.0.0.1:0", 1)
    with pytest.raises(ConfigError, match="insecure"):
        ShardCoordinator("tcp://127.0.0.1:0", "tcp://0.0.0.0:0", 1)
    with pytest.raises(ConfigError, match="curve_allowed_clients_dir"):
        ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 1,
                         curve_allowed_clients_dir=keys["allowed"])
    with ShardCoordinator("tcp://0.0.0.0:0", "tcp://0.0.0.0:0", 1,
                          curve_secret_key_file=keys["secret"]) as coordinator:
        assert coordinator.collect_endpoint.startswith("tcp://0.0.0.0:")


def test_peers_share_a_curve_sharded_version(keys: dict[str, Any]) -> None:
    """Under CURVE the coordinator's tracker sees each member's authenticated key and
    plans it into the others' admit lists: the members fetch from each other too."""
    members = [create_key_pair(keys["allowed"], f"member{i}")[1] for i in range(2)]
    with _ranks(keys, [keys["allowed"], keys["allowed"]]) as ranks:
        coordinator = ranks[0].coordinator
        assert coordinator is not None
        subs = [WeightSubscriber(coordinator.endpoint, curve_server_key_file=keys["public"],
                                 curve_secret_key_file=str(secret), peer_share=True,
                                 request_timeout=2.0, upload_mbit=16) for secret in members]
        try:
            def planned() -> bool:
                plans = [sub.status()["peers"] for sub in subs]
                return sorted(p["slot"] for p in plans if p["slot"] is not None) == [0, 1] \
                    and len({p["plan_epoch"] for p in plans}) == 1

            wait_until(planned, 20, "both members in one plan")
            for version in (1, 2):
                expected = _publish(ranks, version)
                for sub in subs:
                    staged = sub.wait_for_version(version, timeout=30)
                    for name, want in expected.items():
                        assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want))
            statuses = [sub.status() for sub in subs]
            # (which member waits for the other's stripe is a race on versions this small)
            assert sum(s["peers"]["bytes_from_peers"] for s in statuses) > 0, statuses
            assert all(s["last_error"] is None for s in statuses), statuses
        finally:
            for sub in subs:
                sub.close()
