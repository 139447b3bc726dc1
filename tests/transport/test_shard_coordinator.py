"""The shard coordinator stays up and bounded whatever reaches its collect socket.

A stray or broken peer on the collect ROUTER (garbage, a rank outside the
group, versions far ahead) is refused or costs old pending versions, never the
collecting thread or unbounded memory: the ranks' next complete version is
still announced.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from publisher.sharding.shard_coordinator import MAX_PENDING_VERSIONS, ShardCoordinator
from tests.test_layers import REPO
from tests.transport.faults.test_resources import _zmtp_null_dealer
from tests.transport.faults.tools import rss_mib
from tests.transport.procs import wait_until
from tests.transport.test_sharded import _submit
from weightpub_wire import protocol as wire
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError
from weightpub_wire.shard_submit import ShardSubmit, decoded_bytes, encode_submit

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


# -- issue 28.3: memory bounded by what it holds decoded, given back, the collect socket guarded


def _big_submit(rank: int, version: int, checksums: int, world: int) -> ShardSubmit:
    """A valid shard of ``checksums`` chunks: random 64-bit checksums, the costliest decoded."""
    rng = random.Random(rank * 1000 + version)
    chunk = 1 << 16
    entry = wire.TensorEntry(name=f"t{rank}", dtype="uint8", shape=(checksums * chunk,),
                             offset=0, nbytes=checksums * chunk)
    return ShardSubmit(rank=rank, world_size=world, version=version, publisher_id=f"r{rank}",
                       endpoint=f"tcp://127.0.0.1:{9000 + rank}", chunk_size=chunk,
                       total_bytes=checksums * chunk, tensors=(entry,),
                       checksums=tuple(rng.getrandbits(64) for _ in range(checksums)))


def test_pending_submits_beyond_the_decoded_bound_are_refused_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """The audit: the bound counted frame bytes, a decoded submit costs 3-13x them. Now three
    submits of ~2.2 MB decoded fill an 8 MiB bound; the next ones are refused (WARNING)."""
    bound = 8 << 20
    submits = [_big_submit(rank, 5, 40_000, 8) for rank in range(5)]
    assert 3 * decoded_bytes(submits[0]) <= bound < 4 * decoded_bytes(submits[0])
    frames = [encode_submit(s) for s in submits]
    assert sum(map(len, frames)) < bound // 4  # the frames alone fit many times
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 8,
                          max_pending_bytes=bound) as coord, \
            caplog.at_level(logging.WARNING, logger="weightpub.publisher"):
        ctx: zmq.Context = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(coord.collect_endpoint)
            for frame in frames:
                dealer.send(frame)
            wait_until(lambda: coord.refused_submits == 2, 20, "two submits refused")
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert coord.pending_bytes == 3 * decoded_bytes(submits[0]) <= bound
        refusals = [r for r in caplog.records if "does not fit" in r.getMessage()]
        assert len(refusals) == 2 and all(r.levelno == logging.WARNING for r in refusals)
        assert "max_pending_bytes 8388608" in coord.last_error
        assert coord.group_status().refused_submits == 2


def test_a_multipart_message_that_never_ends_is_cut_at_the_collect_socket() -> None:
    """The audit: 260 MiB of frames with MORE set were held and the connection never cut.
    Now the publisher's own guard watches the collect socket: cut within a few frames'
    worth, and the ranks' next version is still announced."""
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2,
                          max_pending_bytes=16 << 20) as coord:
        port = parse_endpoint(coord.collect_endpoint).port
        assert port is not None
        raw = _zmtp_null_dealer(port)
        size = 256 << 10  # under the collect socket's MAXMSGSIZE (16 MiB / 16)
        frame = b"\x03" + struct.pack(">Q", size) + b"x" * size
        sent, cut = 0, None
        # the guard checks on its own clock: after the first 32 MiB the sender slows to
        # about 40 MB/s, so a loaded box (3 xdist workers beside engines) still sees the
        # cut inside the deadline without the test process holding GiBs meanwhile
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                raw.sendall(frame * 8)
                sent += 8 * size
                if sent > 32 << 20:
                    time.sleep(0.05)
        except OSError as exc:
            cut = type(exc).__name__
        finally:
            raw.close()
        print(f"\nnever-ending multipart to the collect socket: cut ({cut}) after "
              f"{sent >> 20} MiB (audit: 260 MiB held, never cut)")
        # cut before the 256 MiB the audit's sender got through. What the sender counts
        # includes the kernel's socket buffers and the guard's reaction time, which a
        # loaded box stretches: 8-68 MiB measured with 3 xdist workers on 2 cores, more
        # beside other jobs, so the figure is printed, not bounded; the coordinator itself
        # holds at most its 10 MiB guard (cut_connections below)
        assert cut is not None, f"never cut: {sent >> 20} MiB sent in 30 s"
        wait_until(lambda: coord.cut_connections >= 1, 10, "the cut counted")
        ctx: zmq.Context = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(coord.collect_endpoint)
            for rank in (0, 1):
                dealer.send(encode_submit(_submit(rank, 7)))
            coord.wait_announced(7, timeout=10)
        finally:
            dealer.close(linger=0)
            ctx.term()


_COORDINATOR = """
import sys
from publisher.sharding.shard_coordinator import ShardCoordinator
c = ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 8, shard_timeout=2.0,
                     max_pending_bytes=256 << 20)
print(c.collect_endpoint, flush=True)
for line in sys.stdin:
    print(c.dropped_versions, c.refused_submits, c.pending_bytes, flush=True)
"""


def test_the_coordinators_memory_is_bounded_and_given_back_after_expiry() -> None:
    """The audit: 177 MiB of pending valid submits took a coordinator from 237 to 1,194 MiB,
    and 8 x 59 MiB were never given back. A fresh coordinator process (RSS from /proc) is
    sent seven ranks' submits of a version that never completes (12.9 MiB frames, 84 MB
    decoded each): it holds at most its 256 MiB bound beside one decoding, and once the
    version expires its RSS is back near where it started (before: 258 -> 837 -> 323 MiB)."""
    bound = 256 << 20
    proc = subprocess.Popen([sys.executable, "-c", _COORDINATOR], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    ctx: zmq.Context = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        collect = proc.stdout.readline().strip()
        frames = [encode_submit(_big_submit(rank, 5, 1_500_000, 8)) for rank in range(7)]
        time.sleep(0.3)
        base = peak = rss_mib(proc.pid)
        dealer.connect(collect)
        for frame in frames:
            dealer.send(frame)

        def status() -> list[int]:
            proc.stdin.write("status\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            return [int(v) for v in proc.stdout.readline().split()]  # type: ignore[union-attr]

        deadline = time.monotonic() + 60
        while status()[0] < 1:  # the version expired (shard_timeout 2 s)
            assert time.monotonic() < deadline, "the version never expired"
            peak = max(peak, rss_mib(proc.pid))
            time.sleep(0.05)
        time.sleep(0.5)
        after = rss_mib(proc.pid)
        dropped, refused, pending = status()
        print(f"\ncoordinator RSS: {base:.0f} MiB, peak {peak:.0f} with the bound at "
              f"{bound >> 20} MiB decoded, {after:.0f} after expiry ({refused} of 7 submits "
              "refused; before: 258 -> 837 -> 323)")
        assert dropped == 1 and refused >= 1 and pending == 0
        assert peak - base < 2 * (bound >> 20), (base, peak)
        assert after < 1.1 * base, (base, after)
    finally:
        dealer.close(linger=0)
        ctx.term()
        proc.stdin.close()
        proc.wait(10)


def test_a_ranks_nixl_offer_is_counted_decoded_and_passed_into_the_union() -> None:
    """A submit's NIXL offer (issue 31) counts in its decoded bytes (the metadata blob is
    the bulk) and the coordinator puts it in that rank's ``ShardSource.nixl``; a rank
    without one has None there."""
    from weightpub_wire.nixl_link import NixlOffer, NixlRegion
    from weightpub_wire.shard_submit import decode_submit

    chunk = 1 << 16
    offer = NixlOffer("rank0-agent", b"m" * 50_000, [NixlRegion(1 << 20, 4 * chunk)])
    plain = [_big_submit(rank, 1, 4, 2) for rank in range(2)]
    offered = msgspec.structs.replace(plain[0], nixl=offer)
    assert decoded_bytes(offered) >= decoded_bytes(plain[0]) + 50_000
    frame = encode_submit(offered)
    assert decode_submit(frame, len(frame)).nixl == offer
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2) as coord:
        union = coord._union(1, {0: offered, 1: plain[1]})
    assert union.shards is not None
    assert union.shards[0].nixl == offer and union.shards[1].nixl is None
    assert wire.decode_as(wire.encode(union), wire.Manifest) == union  # travels as it is
