"""The shard coordinator stays up and bounded whatever reaches its collect socket.

A stray or broken peer on the collect ROUTER (garbage, a rank outside the
group, versions far ahead) is refused or costs old pending versions, never the
collecting thread or unbounded memory: the ranks' next complete version is
still announced.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from publisher.sharding.shard_coordinator import MAX_PENDING_VERSIONS, ShardCoordinator
from tests.transport.procs import wait_until
from tests.transport.test_sharded import _submit
from weightpub_wire.errors import ConfigError
from weightpub_wire.shard_submit import encode_submit

pytestmark = pytest.mark.timeout(60)


def test_a_stray_peer_on_the_collect_socket_cannot_stop_the_next_version() -> None:
    bogus = msgspec.msgpack.encode({**msgspec.structs.asdict(_submit(0, 5)), "rank": 3,
                                    "t": "shard_submit"})
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2) as coord:
        ctx: zmq.Context = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(coord.collect_endpoint)
            dealer.send(bogus)  # rank 3 of a group of 2
            wait_until(lambda: coord.refused_submits == 1, 10, "the bogus rank refused")
            assert "rank: 3 is not below world_size 2" in coord.last_error
            dealer.send(b"\x93garbage")
            dealer.send_multipart([b"two", b"frames"])
            wait_until(lambda: coord.refused_submits == 3, 10, "three refusals")
            for rank in (0, 1):  # the real ranks, on the same socket
                dealer.send(encode_submit(_submit(rank, 5)))
            coord.wait_announced(5, timeout=10)
        finally:
            dealer.close(linger=0)
            ctx.term()
        manifest = coord.manifest()
        assert manifest is not None and manifest.checksums == (0, 1)


def test_pending_versions_are_bounded_in_number_and_bytes() -> None:
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2,
                          max_pending_bytes=1 << 20) as coord:
        now = time.monotonic()
        far_ahead = range(100, 100 + MAX_PENDING_VERSIONS + 2)
        for version in far_ahead:  # rank 0 alone, version after version
            coord.submitted(_submit(0, version), now, nbytes=1000)
        assert coord.dropped_versions == 2 and "versions" in coord.last_error
        assert coord.pending_bytes == MAX_PENDING_VERSIONS * 1000
        coord.submitted(_submit(1, far_ahead[-1]), now, nbytes=1000)  # completes the newest
        assert coord.latest_version == far_ahead[-1]
        assert coord.pending_bytes == 0  # the older pending ones were dropped at the announce
        # bytes: two big submits of different versions cannot both be held
        coord.submitted(_submit(0, 200), now, nbytes=700 << 10)
        coord.submitted(_submit(0, 201), now, nbytes=700 << 10)
        assert coord.pending_bytes == 700 << 10
        assert "bytes" in coord.last_error
        coord.submitted(_submit(1, 202), now, nbytes=2 << 20)  # larger than the bound alone
        assert "more than" in coord.last_error and coord.pending_bytes == 700 << 10
        coord.submitted(_submit(1, 201), now, nbytes=1000)
        assert coord.latest_version == 201


def test_the_pending_bound_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_pending_bytes"):
        ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2, max_pending_bytes=10)
